"""The record readers: JSON arrays (streamed), Parquet files, save_to_disk directories; every record
that cannot be read is one error at its place, never the end of the file's good records."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dfp_shared.record_sources import (
    ARROW,
    JSON_ARRAY,
    LINES,
    MALFORMED_JSON,
    PARQUET,
    RECORD_TOO_LONG,
    TRUNCATED_FILE,
    UNREADABLE_FILE,
    RecordError,
    detect_format,
    iter_records,
    select_inputs,
)
from dfp_shared.record_sources.json_array import iter_array
from dfp_shared.storage.store import open_store


def conv(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}


def write_array(path: Path, rows: list, indent: int | None = 2) -> bytes:
    data = json.dumps(rows, indent=indent).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def split(items) -> tuple[list, list]:
    good, bad = [], []
    for pos, item in items:
        (bad if isinstance(item, RecordError) else good).append((pos, item))
    return good, bad


def test_array_records_stream_with_their_index(tmp_path):
    write_array(tmp_path / "a.json", [conv(i) for i in range(5)])
    store = open_store(str(tmp_path))
    assert detect_format(store, "a.json") == JSON_ARRAY
    good, bad = split(iter_records(store, "a.json", JSON_ARRAY))
    assert [p for p, _ in good] == [0, 1, 2, 3, 4] and good[3][1] == conv(3) and not bad
    # a range is read by skipping to its start, and stops after its end
    assert [p for p, _ in iter_records(store, "a.json", JSON_ARRAY, start=2, end=4)] == [2, 3]


def test_a_json_lines_file_named_json_stays_lines(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps(conv(0)) + "\n" + json.dumps(conv(1)) + "\n")
    (tmp_path / "g.json.gz").write_bytes(gzip.compress(json.dumps([conv(0)]).encode()))
    store = open_store(str(tmp_path))
    assert detect_format(store, "l.json") == LINES and detect_format(store, "g.json.gz") == JSON_ARRAY
    assert [p for p, _ in iter_records(store, "g.json.gz", JSON_ARRAY)] == [0]


def test_truncated_array_yields_every_whole_record_and_one_error_at_the_end(tmp_path):
    data = write_array(tmp_path / "full.json", [conv(i) for i in range(4)])
    cut = data[: data.index(b'"c3"') + 10]  # inside record 3, no closing bracket
    (tmp_path / "cut.json").write_bytes(cut)
    good, bad = split(iter_records(open_store(str(tmp_path)), "cut.json", JSON_ARRAY))
    assert [p for p, _ in good] == [0, 1, 2]
    assert len(bad) == 1 and bad[0][0] == 3 and bad[0][1].code == TRUNCATED_FILE
    assert f"ends at byte {len(cut)} mid-record" in bad[0][1].reason
    # a shard whose range holds the cut record reports it, one before it does not
    assert [p for p, _ in iter_records(open_store(str(tmp_path)), "cut.json", JSON_ARRAY, start=3)] == [3]
    assert [p for p, _ in iter_records(open_store(str(tmp_path)), "cut.json", JSON_ARRAY, end=3)] == [0, 1, 2]


def test_array_without_its_closing_bracket(tmp_path):
    data = write_array(tmp_path / "a.json", [conv(0), conv(1)], indent=None)
    (tmp_path / "a.json").write_bytes(data[:-1])
    good, bad = split(iter_records(open_store(str(tmp_path)), "a.json", JSON_ARRAY))
    assert [p for p, _ in good] == [0, 1]
    assert bad[0][0] == 2 and bad[0][1].code == TRUNCATED_FILE and "without the closing" in bad[0][1].reason


def test_wrong_shapes_and_an_over_long_record_are_errors_at_their_index(tmp_path):
    rows = [conv(0), "a string", [1, 2], conv(3), {"big": "x" * 5000}, conv(5)]
    write_array(tmp_path / "a.json", rows)
    items = list(iter_records(open_store(str(tmp_path)), "a.json", JSON_ARRAY, max_record_bytes=1000))
    assert [p for p, _ in items] == [0, 1, 2, 3, 4, 5]
    assert items[1][1] == "a string" and items[2][1] == [1, 2]  # the caller decides what a record must be
    assert isinstance(items[4][1], RecordError) and items[4][1].code == RECORD_TOO_LONG
    assert items[5][1] == conv(5)


def test_a_syntax_error_ends_the_file_with_one_error(tmp_path):
    (tmp_path / "a.json").write_bytes(b'[{"prompt": "a"}, {"prompt": "b"}, {"prompt": nope}, {"prompt": "d"}]')
    good, bad = split(iter_array((tmp_path / "a.json").open("rb"), chunk_bytes=8))
    assert [p for p, _ in good] == [0, 1]
    assert len(bad) == 1 and bad[0][0] == 2 and bad[0][1].code == MALFORMED_JSON


def test_a_corrupt_gzip_array_is_one_error(tmp_path):
    data = gzip.compress(json.dumps([conv(i) for i in range(200)]).encode())
    (tmp_path / "a.json.gz").write_bytes(data[: len(data) // 2] + b"\x00" * 64 + data[len(data) // 2:])
    good, bad = split(iter_records(open_store(str(tmp_path)), "a.json.gz", JSON_ARRAY))
    assert len(bad) == 1 and bad[0][0] == len(good)


def write_parquet(path: Path, rows: list[dict], row_group_size: int = 3) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def test_parquet_rows_by_row_group_and_range(tmp_path):
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(8)]
    write_parquet(tmp_path / "p.parquet", rows)
    store = open_store(str(tmp_path))
    assert detect_format(store, "p.parquet") == PARQUET
    good, bad = split(iter_records(store, "p.parquet", PARQUET))
    assert [r for _, r in good] == rows and not bad
    assert [p for p, _ in iter_records(store, "p.parquet", PARQUET, start=2, end=7)] == [2, 3, 4, 5, 6]


def test_parquet_nulls_are_absent_keys(tmp_path):
    rows = [{"prompt": "a", "system": None}, {"prompt": None, "system": "s"}]
    write_parquet(tmp_path / "p.parquet", rows)
    assert [r for _, r in iter_records(open_store(str(tmp_path)), "p.parquet", PARQUET)] == [{"prompt": "a"}, {"system": "s"}]


def test_a_corrupt_parquet_file_is_one_file_level_error(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1")
    items = list(iter_records(open_store(str(tmp_path)), "bad.parquet", PARQUET))
    assert len(items) == 1 and items[0][0] == 0 and items[0][1].code == UNREADABLE_FILE
    assert "Parquet" in items[0][1].reason


def test_save_to_disk_directory_is_read_without_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": f"h{i}", "turns": [f"t{i}", "later"]} for i in range(7)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"), num_shards=3)
    store = open_store(str(tmp_path / "hf"))
    keys = select_inputs(sorted(store.list("")), (".jsonl", ".json", ".arrow"))
    assert len(keys) == 3 and all(k.startswith("data-") and k.endswith(".arrow") for k in keys)  # no metadata
    got = [r for key in keys for _, r in iter_records(store, key, detect_format(store, key))]
    assert got == rows
    in_first = len(list(iter_records(store, keys[0], ARROW)))
    assert [p for p, _ in iter_records(store, keys[0], ARROW, start=1)] == list(range(1, in_first))


def test_a_corrupt_arrow_file_is_one_file_level_error(tmp_path):
    (tmp_path / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff garbage")
    items = list(iter_records(open_store(str(tmp_path)), "data-00000-of-00001.arrow", ARROW))
    assert len(items) == 1 and items[0][0] == 0 and items[0][1].code == UNREADABLE_FILE


def test_arrow_file_format_is_read_too(tmp_path):
    table = pa.Table.from_pylist([{"prompt": "a"}, {"prompt": "b"}])
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert [r for _, r in iter_records(open_store(str(tmp_path)), "t.arrow", ARROW)] == [{"prompt": "a"}, {"prompt": "b"}]


def test_records_stream_from_s3(s3_server, s3_bucket, tmp_path):
    rows = [conv(i) for i in range(50)]
    store = open_store(f"{s3_bucket}/in", endpoint_url=s3_server.endpoint_url)
    store.put("a.json", json.dumps(rows).encode())
    write_parquet(tmp_path / "p.parquet", [{"prompt": f"p{i}"} for i in range(10)])
    store.put("p.parquet", (tmp_path / "p.parquet").read_bytes())
    assert detect_format(store, "a.json") == JSON_ARRAY
    assert [r for _, r in iter_records(store, "a.json", JSON_ARRAY, start=40)] == rows[40:]
    assert [p for p, _ in iter_records(store, "p.parquet", PARQUET, start=4, end=8)] == [4, 5, 6, 7]
