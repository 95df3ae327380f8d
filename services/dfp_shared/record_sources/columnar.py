"""Rows of Arrow record batches as plain records (shared by the Parquet and Arrow IPC readers)."""

from __future__ import annotations

from collections.abc import Iterator

from dfp_shared.record_sources.base import UNREADABLE_ROW, RecordError

BATCH_ROWS = 1024


def _without_nulls(value):
    """A row as JSON would have it: a null struct field is an absent key (Arrow has no absent keys)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def batch_rows(batch, first: int, start: int, end: int | None) -> Iterator[tuple[int, object]]:
    """``(row number, record | RecordError)`` of one record batch whose first row is ``first``."""
    lo = max(0, start - first)
    hi = batch.num_rows if end is None else min(batch.num_rows, end - first)
    if hi <= lo:
        return
    part = batch.slice(lo, hi - lo)
    try:
        rows = part.to_pylist()
    except Exception:  # noqa: BLE001 - a value pyarrow cannot convert: find the rows it is in
        rows = None
    for i in range(hi - lo):
        if rows is not None:
            yield first + lo + i, _without_nulls(rows[i])
            continue
        try:
            yield first + lo + i, _without_nulls(part.slice(i, 1).to_pylist()[0])
        except Exception as exc:  # noqa: BLE001 - one row's failure is one bad row
            yield first + lo + i, RecordError(UNREADABLE_ROW, f"cannot read the row ({type(exc).__name__}: {exc})"[:200])
