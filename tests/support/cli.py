"""Running the project's CLI as a subprocess, from this checkout's sources."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli_env(**extra: str) -> dict:
    """The current environment with this checkout's ``services/`` and root first on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(ROOT / "services"), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dfp_cli.main", *args]
