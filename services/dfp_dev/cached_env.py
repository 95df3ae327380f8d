"""A virtual environment of its own under the cache directory, installed once and reused.

``<cache>/<name>-<hash>``: the caller names it and hashes its pins, so a change of pins makes a new one. A stamp
file written last marks a finished install (one without it is removed and installed again); a lock file beside it
keeps concurrent first uses apart; every step's output goes to ``<name>-<hash>.install.log``.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

STAMP = ".dflash-installed"

Run = Callable[[list[str], str], None]  # run(argv, step): one install step, its output to the log


class EnvInstallError(RuntimeError):
    """The environment could not be created or installed (e.g. no network); the message names the step and log."""


def ready_python(root: Path) -> Path | None:
    """The environment's interpreter when its install has finished, else None."""
    python = root / "bin" / "python"
    return python if (root / STAMP).is_file() and python.exists() else None


def ensure(root: Path, install: Callable[[Path, Run], None], stamp: str, *, what: str, echo=print,
           error: type[EnvInstallError] = EnvInstallError) -> Path:
    """The interpreter of the environment at ``root``; when missing, a fresh virtual environment is created and
    ``install(python, run)`` fills it (``run`` raises ``error`` naming a failed step), then ``stamp`` is written."""
    found = ready_python(root)
    if found:
        return found
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent installer finishes first; then it is found
        found = ready_python(root)
        if found:
            return found
        shutil.rmtree(root, ignore_errors=True)  # an install that did not finish
        log_path = root.parent / f"{root.name}.install.log"
        echo(f"installing {what} into {root} (log {log_path})")
        began = time.monotonic()
        with open(log_path, "wb") as log:
            def run(cmd: list[str], step: str) -> None:
                log.write(f"$ {' '.join(cmd)}\n".encode())
                log.flush()
                code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                if code:
                    raise error(f"{step} failed (exit {code}): {' '.join(cmd)}; see {log.name}")

            base = getattr(sys, "_base_executable", None) or sys.executable
            run([base, "-m", "venv", str(root)], "creating the virtual environment")
            install(root / "bin" / "python", run)
        (root / STAMP).write_text(f"{stamp}\ninstalled in {time.monotonic() - began:.0f}s\n")
        echo(f"environment {root.name} ready in {time.monotonic() - began:.0f}s")
        return root / "bin" / "python"
