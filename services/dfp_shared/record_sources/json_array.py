"""One top-level JSON array of records (e.g. ShareGPT's ``[{"id": ..., "conversations": [...]}, ...]``), streamed.

The file is parsed with ijson as it is read, one record built at a time, so memory follows the
largest record, not the file. Records before ``start`` are parsed but not built (a shard that
begins deep in a big file skips to its start this way). What cannot be read is a
:class:`~.base.RecordError` at the position it concerns:

* a record larger than ``max_record_bytes`` (measured on its decoded text: strings, keys and
  numbers) is dropped unbuilt and reported at its index;
* a file cut off mid-record (a truncated download) yields every whole record, then one error at
  the cut record's index naming the byte offset where the file ends; a missing closing ``]``
  after a whole record is one error at the next index;
* a stream that cannot be read on (a corrupt gzip file) ends the file with one error at the index
  being read;
* a syntax error ends the file: one error at the index being read, naming the byte range of the
  chunk it was found in (the parser cannot resynchronise inside broken JSON).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import BinaryIO

import ijson

from dfp_shared.record_sources.base import (
    MALFORMED_JSON,
    RECORD_TOO_LONG,
    TRUNCATED_FILE,
    UNREADABLE_FILE,
    RecordError,
)

CHUNK_BYTES = 256 * 1024
_CONTAINER_START = ("start_map", "start_array")
_CONTAINER_END = ("end_map", "end_array")


def _size(event: str, value) -> int:
    """About how many bytes of JSON text an event stands for."""
    if event in ("string", "map_key"):
        return len(value) + 3
    return 8 if event == "number" else 2


def _handle(state: dict, wanted, max_record_bytes: int | None, event: str, value) -> Iterator[tuple[int, object]]:
    """The records one parser event completes (the state of :func:`iter_array`'s walk updated)."""
    depth = state["depth"]
    if depth < 0:
        return
    if depth == 0:
        if event != "start_array":
            state["depth"] = -1  # not an array: nothing more is read
            if wanted(0):
                yield 0, RecordError(MALFORMED_JSON, f"not a JSON array (it starts with a {event})")
        state["depth"] = 1
        return
    if depth == 1:
        if event == "end_array":
            state["depth"] = 0
            return
        state["index"] += 1
        index = state["index"]
        if event not in _CONTAINER_START:  # a bare value where a record should be
            if wanted(index):
                yield index, value
            return
        state["depth"] = 2
        state["size"] = _size(event, value)
        state["dropped"] = False
        state["builder"] = ijson.ObjectBuilder() if wanted(index) else None
        if state["builder"] is not None:
            state["builder"].event(event, value)
        return
    # inside a record
    if event in _CONTAINER_START:
        state["depth"] += 1
    elif event in _CONTAINER_END:
        state["depth"] -= 1
    builder = state["builder"]
    if builder is not None:
        state["size"] += _size(event, value)
        if max_record_bytes is not None and state["size"] > max_record_bytes:
            state["builder"], state["dropped"] = None, True
        else:
            builder.event(event, value)
    if state["depth"] == 1:  # the record is complete
        index = state["index"]
        if builder is not None and state["builder"] is not None:
            yield index, builder.value
        elif state["dropped"]:
            yield index, RecordError(RECORD_TOO_LONG, f"record longer than the limit of {max_record_bytes} bytes")
        state["builder"] = None


def iter_array(stream: BinaryIO, start: int = 0, end: int | None = None,
               max_record_bytes: int | None = None, chunk_bytes: int = CHUNK_BYTES
               ) -> Iterator[tuple[int, object]]:
    """``(index, record | RecordError)`` of the array's records with ``start <= index < end``."""
    events = ijson.sendable_list()
    parser = ijson.basic_parse_coro(events, use_float=True)
    state: dict = {"depth": 0, "index": -1, "builder": None, "size": 0, "dropped": False}
    offset = 0

    def wanted(index: int) -> bool:
        return index >= start and (end is None or index < end)

    def handle(event: str, value) -> Iterator[tuple[int, object]]:
        return _handle(state, wanted, max_record_bytes, event, value)

    def current() -> int:
        """The index of the record being read (or the next one, between records)."""
        return state["index"] if state["depth"] > 1 else state["index"] + 1

    while True:
        if state["depth"] < 0 or (end is not None and state["index"] >= end - 1 and state["depth"] <= 1):
            return  # not an array, or past the range: the rest of the file is not read
        try:
            data = stream.read(chunk_bytes)
        except (OSError, EOFError, zlib.error) as exc:  # e.g. a corrupt gzip stream
            if wanted(current()):
                yield current(), RecordError(UNREADABLE_FILE, f"the file cannot be read past byte {offset} "
                                                              f"of its content ({_message(exc)})")
            return
        if not data:
            break
        before, offset = offset, offset + len(data)
        try:
            parser.send(data)
        except ijson.JSONError as exc:
            for event, value in events:
                yield from handle(event, value)
            if wanted(current()):
                yield current(), RecordError(MALFORMED_JSON, f"invalid JSON in bytes {before}-{offset} of the file "
                                                             f"({_message(exc)}); the rest of the file is not read")
            return
        for event, value in events:
            yield from handle(event, value)
        del events[:]
    try:
        parser.close()
    except ijson.IncompleteJSONError:
        for event, value in events:
            yield from handle(event, value)
        if state["depth"] == 0 and state["index"] < 0:
            if wanted(0):
                yield 0, RecordError(TRUNCATED_FILE, f"the file ends at byte {offset} before its array starts")
        elif wanted(current()):
            where = (f"mid-record (record {current()} is cut off)" if state["depth"] > 1
                     else "after a whole record, without the closing ']'")
            yield current(), RecordError(TRUNCATED_FILE, f"the file ends at byte {offset} {where}")
        return
    except ijson.JSONError as exc:
        if wanted(current()):
            yield current(), RecordError(MALFORMED_JSON, f"invalid JSON at the end of the file ({_message(exc)})")
        return
    for event, value in events:
        yield from handle(event, value)


def _message(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 160 else text[:157] + "..."
