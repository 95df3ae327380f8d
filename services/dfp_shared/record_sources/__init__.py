"""Records of input files in the shapes users bring, each with its place in the file.

A reader yields ``(position, item)`` pairs: ``item`` is a decoded record (a dict for a well-formed
one, whatever JSON value stood there otherwise) or a :class:`RecordError` naming why the record
at that position cannot be read. Positions are 0-based record indexes (JSON arrays) or row numbers
(Parquet, Arrow); JSONL files stay with their callers' line readers (1-based line numbers).

* :mod:`.json_array`: one top-level JSON array of records (ShareGPT-style ``[...]``), streamed;
* :mod:`.parquet`: Parquet files, row group by row group;
* :mod:`.arrow_ipc`: Arrow IPC files, as ``datasets``' ``save_to_disk`` writes ``data-*.arrow``.

What a record means (a prompt, a training conversation) is for the caller to decide.
"""

from dfp_shared.record_sources.base import (
    ARROW,
    DEFAULT_MAX_RECORD_BYTES,
    JSON_ARRAY,
    LINES,
    MALFORMED_JSON,
    PARQUET,
    RECORD_TOO_LONG,
    TRUNCATED_FILE,
    UNREADABLE_FILE,
    UNREADABLE_ROW,
    RecordError,
    select_inputs,
    unit_of,
)
from dfp_shared.record_sources.open import detect_format, iter_records

__all__ = ["ARROW", "DEFAULT_MAX_RECORD_BYTES", "JSON_ARRAY", "LINES", "MALFORMED_JSON", "PARQUET", "RECORD_TOO_LONG",
           "TRUNCATED_FILE", "UNREADABLE_FILE", "UNREADABLE_ROW", "RecordError", "detect_format", "iter_records",
           "select_inputs", "unit_of"]
