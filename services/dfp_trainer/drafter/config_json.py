"""Reading a Hugging Face-style ``config.json``, with errors that name the file (and the line)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dfp_shared.models.loading import MAX_CONFIG_BYTES


def read_config_json(path: Path, missing: str, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """The JSON object in ``path``; FileNotFoundError ``"{path}: {missing}"`` when there is no such file,
    ValueError naming the file when it is longer than ``max_bytes`` (read no further) or not a JSON object."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {missing}")
    with path.open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size <= max_bytes:  # no buffer larger than the file (one that grows is read one byte further)
            raw = handle.read(size + 1)
    if size > max_bytes or len(raw) > max_bytes:
        raise ValueError(f"{path}: longer than {max_bytes:,} bytes, the most a config.json may hold")
    try:
        data = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # not UTF-8, a huge number, deep nesting
        raise ValueError(f"{path}: not a JSON file this reader takes ({type(exc).__name__}: {str(exc)[:200]})") \
            from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data
