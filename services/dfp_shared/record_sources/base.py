"""The common vocabulary of the record readers: formats, error codes, which keys are inputs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

LINES = "lines"
JSON_ARRAY = "json_array"
PARQUET = "parquet"
ARROW = "arrow"

DEFAULT_MAX_RECORD_BYTES = 4 * 1024 * 1024
"""A JSON-array record larger than this is skipped (and counted), as an over-long JSONL line is."""

# error codes (the tokenizer counts bad records by these)
MALFORMED_JSON = "malformed_json"
RECORD_TOO_LONG = "record_too_long"
TRUNCATED_FILE = "truncated_file"
UNREADABLE_FILE = "unreadable_file"
UNREADABLE_ROW = "unreadable_row"

# files that mark a ``datasets`` save_to_disk directory (only its ``.arrow`` files hold rows)
HF_MARKERS = ("state.json", "dataset_dict.json")


@dataclass(frozen=True)
class RecordError:
    """Why the record at a position (or, for a whole-file error, the file from there on) cannot be read."""

    code: str
    reason: str


def unit_of(fmt: str) -> str:
    """What a position counts in a file of this format."""
    return {LINES: "line", JSON_ARRAY: "record"}.get(fmt, "row")


def _directory(key: str) -> str:
    return key.rpartition("/")[0]


def select_inputs(keys: Iterable[str], suffixes: tuple[str, ...]) -> list[str]:
    """The input files among ``keys`` (listed under one prefix): those with one of ``suffixes``, except in a
    ``datasets`` save_to_disk directory (one holding ``state.json`` or ``dataset_dict.json``), where only its
    ``.arrow`` files count."""
    keys = list(keys)
    hf_dirs = {_directory(k) for k in keys if k.rpartition("/")[2] in HF_MARKERS}
    out = []
    for key in keys:
        if _directory(key) in hf_dirs:
            if key.endswith(".arrow"):
                out.append(key)
        elif key.endswith(suffixes):
            out.append(key)
    return out
