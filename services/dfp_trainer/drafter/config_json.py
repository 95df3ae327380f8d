"""Reading a Hugging Face-style ``config.json``, with errors that name the file (and the line)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_config_json(path: Path, missing: str) -> dict[str, Any]:
    """The JSON object in ``path``; FileNotFoundError ``"{path}: {missing}"`` when there is no such file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {missing}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data
