"""Which reader a file needs, and its records through the project's object store."""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator

from dfp_shared.record_sources.arrow_ipc import iter_arrow
from dfp_shared.record_sources.base import ARROW, JSON_ARRAY, LINES, PARQUET
from dfp_shared.record_sources.json_array import iter_array
from dfp_shared.record_sources.parquet import iter_parquet
from dfp_shared.storage.store import ObjectStore

SNIFF_BYTES = 4096
_SNIFFED = (".json", ".json.gz")  # JSON Lines or one JSON array: the first byte tells


def _first_byte(head: bytes) -> bytes:
    return head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]


def detect_format(store: ObjectStore, key: str) -> str:
    """The format of ``key``: by suffix, and for ``.json``/``.json.gz`` by whether it starts with ``[``."""
    if key.endswith(".parquet"):
        return PARQUET
    if key.endswith(".arrow"):
        return ARROW
    if not key.endswith(_SNIFFED):
        return LINES
    with store.open_read(key) as raw:
        if key.endswith(".gz"):
            try:
                with gzip.GzipFile(fileobj=raw) as gz:
                    head = gz.read(SNIFF_BYTES)
            except (OSError, EOFError):
                return LINES  # the line reader reports a corrupt gzip file as it always has
        else:
            head = raw.read(SNIFF_BYTES)
    return JSON_ARRAY if _first_byte(head) == b"[" else LINES


def iter_records(store: ObjectStore, key: str, fmt: str, start: int = 0, end: int | None = None,
                 max_record_bytes: int | None = None) -> Iterator[tuple[int, object]]:
    """``(position, record | RecordError)`` of ``key`` (not for JSON Lines: callers read lines themselves)."""
    if fmt == LINES:
        raise ValueError(f"{key}: JSON Lines files are read line by line, not here")
    with store.open_read(key) as raw:
        if fmt == JSON_ARRAY:
            stream = gzip.GzipFile(fileobj=raw) if key.endswith(".gz") else raw
            yield from iter_array(stream, start, end, max_record_bytes)
        elif fmt == PARQUET:
            yield from iter_parquet(_seekable(raw), start, end)
        elif fmt == ARROW:
            yield from iter_arrow(_seekable(raw), start, end)
        else:
            raise ValueError(f"unknown record format {fmt!r}")


def _seekable(raw):
    return raw if raw.seekable() else io.BytesIO(raw.read())
