"""Parquet files, read row group by row group (a reader with a row range opens only the groups it covers).

Each row becomes one record: its columns as keys, nested lists and structs as JSON would hold them
(``messages``/``conversations`` as lists of ``{role, content}``/``{from, value}`` structs, ``prompt``
a string, ``turns`` a list of strings). A file pyarrow cannot open is one error at row 0; a row
group it cannot read is one error at the group's first row, and reading goes on with the next group.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from dfp_shared.record_sources.base import UNREADABLE_FILE, RecordError
from dfp_shared.record_sources.columnar import BATCH_ROWS, batch_rows


def iter_parquet(stream: BinaryIO, start: int = 0, end: int | None = None) -> Iterator[tuple[int, object]]:
    """``(row, record | RecordError)`` of the rows with ``start <= row < end``."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(stream)
        sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, it is one file-level error
        if start <= 0:
            yield 0, RecordError(UNREADABLE_FILE, f"not a readable Parquet file ({type(exc).__name__}: {exc})"[:240])
        return
    first = 0
    for group, rows in enumerate(sizes):
        if end is not None and first >= end:
            return
        if first + rows > start:
            try:
                batches = list(pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[group]))
            except Exception as exc:  # noqa: BLE001 - one unreadable group: one error, the others still count
                if first >= start:
                    yield first, RecordError(UNREADABLE_FILE, f"row group {group} (rows {first}-{first + rows - 1}) "
                                                              f"cannot be read ({type(exc).__name__}: {exc})"[:240])
                first += rows
                continue
            row = first
            for batch in batches:
                yield from batch_rows(batch, row, start, end)
                row += batch.num_rows
        first += rows
