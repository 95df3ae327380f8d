"""Arrow IPC files: the ``data-*.arrow`` files of a ``datasets`` ``save_to_disk`` directory.

``datasets`` writes them in the Arrow streaming format; the random-access file format is read too.
They are read with pyarrow directly, record batch by record batch (``datasets`` is not needed).
Rows become records as for Parquet (see :mod:`.parquet`). A file pyarrow cannot open is one error at
row 0; a batch it cannot read ends the file with one error at the row where it would start.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from dfp_shared.record_sources.base import UNREADABLE_FILE, RecordError
from dfp_shared.record_sources.columnar import batch_rows


def _batches(stream: BinaryIO):
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(stream)
    except pa.ArrowInvalid:
        stream.seek(0)
        reader = pa.ipc.open_file(stream)
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def iter_arrow(stream: BinaryIO, start: int = 0, end: int | None = None) -> Iterator[tuple[int, object]]:
    """``(row, record | RecordError)`` of the rows with ``start <= row < end``."""
    try:
        batches = _batches(stream)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, it is one file-level error
        if start <= 0:
            yield 0, RecordError(UNREADABLE_FILE, f"not a readable Arrow file ({type(exc).__name__}: {exc})"[:240])
        return
    first = 0
    while end is None or first < end:
        try:
            batch = next(batches, None)
        except Exception as exc:  # noqa: BLE001 - a corrupt batch: the stream cannot go on past it
            if first >= start:
                yield first, RecordError(UNREADABLE_FILE, f"record batch at row {first} cannot be read "
                                                          f"({type(exc).__name__}: {exc})"[:240])
            return
        if batch is None:
            return
        yield from batch_rows(batch, first, start, end)
        first += batch.num_rows
