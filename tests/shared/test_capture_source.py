"""Captured traffic as training data: the window's hour shards, incomplete records dropped, the newest share
held out as prompts, greedy records trained on as they are and sampled ones regenerated (or not)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from dfp_adapt.source import SourceError, prepare_source, window, window_hours
from dfp_shared.records.completions import completion_record, encode_records
from dfp_shared.records.prompts import read_prompt_set
from dfp_shared.storage.store import open_store

T0 = datetime(2026, 3, 1, 10, 0, tzinfo=timezone.utc)


def record(n: int, at: datetime, greedy: bool, incomplete: bool = False) -> dict:
    meta = {"source": "capture", "captured_at": at.strftime("%Y-%m-%dT%H:%M:%SZ"), "greedy": greedy,
            "incomplete": incomplete, "model": "m", "sampling": {"temperature": 0 if greedy else 0.7}}
    return completion_record(f"r{n}", [{"role": "user", "content": f"question {n}"}], f"answer {n}", None, meta)


def write_capture(uri: str, endpoint_url: str | None = None) -> list[dict]:
    """Three hours of traffic, 10 records an hour, every third sampled, one incomplete, plus a record outside."""
    store = open_store(uri, endpoint_url=endpoint_url)
    written = []
    for hour in range(3):
        rows = [record(hour * 10 + i, T0 + timedelta(hours=hour, minutes=5 * i), greedy=i % 3 != 0,
                       incomplete=(hour, i) == (1, 4)) for i in range(10)]
        data = encode_records(rows[:5]) + b"not json\n"
        store.put(f"completions/{(T0 + timedelta(hours=hour)):%Y%m%dT%H}/w0-b-000001.jsonl", data)
        store.put(f"completions/{(T0 + timedelta(hours=hour)):%Y%m%dT%H}/w1-b-000001.jsonl", encode_records(rows[5:]))
        written += rows
    store.put(f"completions/{(T0 + timedelta(hours=5)):%Y%m%dT%H}/w0-b-000001.jsonl",
              encode_records([record(99, T0 + timedelta(hours=5), True)]))
    return written


def lines(store, prefix: str) -> list[dict]:
    return [json.loads(line) for k in store.list(prefix) for line in store.get(k).splitlines()]


@pytest.mark.parametrize("regenerate", [True, False])
def test_the_window_is_split_into_greedy_sampled_and_held_out(tmp_path, regenerate):
    written = write_capture(f"file://{tmp_path}/capture")
    split = prepare_source(f"file://{tmp_path}/capture", f"file://{tmp_path}/run", T0, T0 + timedelta(hours=3),
                           heldout_share=0.2, regenerate=regenerate)
    assert split.shards == 6
    assert split.dropped == {"incomplete": 1, "unreadable": 3, "long_line": 0}
    usable = [r for r in written if not r["meta"]["incomplete"]]  # 29, the record at hour 5 is outside
    held = round(len(usable) * 0.2)
    newest = sorted(usable, key=lambda r: r["meta"]["captured_at"])[-held:]
    out = open_store(f"file://{tmp_path}/run")
    prompts = lines(out, "heldout/")
    assert split.heldout_records == held == len(prompts)
    assert {p["id"] for p in prompts} == {r["id"] for r in newest}
    assert all(p["messages"] == [m for m in r["messages"] if m["role"] == "user"]
               for p, r in zip(sorted(prompts, key=lambda p: p["id"]), sorted(newest, key=lambda r: r["id"])))
    trained = [r for r in usable if r not in newest]
    data = lines(out, "data/")
    if regenerate:
        assert data == [r for r in trained if r["meta"]["greedy"]]  # as they are, in capture order
        regen = lines(out, "regenerate/")
        assert [p["id"] for p in regen] == [r["id"] for r in trained if not r["meta"]["greedy"]]
        assert all(p["messages"][-1]["role"] == "user" for p in regen)
        assert split.regenerate == f"file://{tmp_path}/run/regenerate/"
    else:
        assert data == trained and split.regenerate is None and not list(out.list("regenerate/"))
    assert split.greedy + split.sampled == len(trained)
    # the held-out slice is a prompt set the evaluate and generate jobs read
    prompts_read, errors = read_prompt_set(split.heldout)
    assert len(prompts_read) == held and not errors


def test_the_source_reads_s3(s3_server, s3_bucket):
    write_capture(f"{s3_bucket}/capture", s3_server.endpoint_url)
    split = prepare_source(f"{s3_bucket}/capture", f"{s3_bucket}/run", T0 + timedelta(hours=1),
                           T0 + timedelta(hours=2), heldout_share=0.5, regenerate=True,
                           endpoint_url=s3_server.endpoint_url)
    assert split.shards == 2 and split.heldout_records == 4 and split.dropped["incomplete"] == 1
    assert split.greedy + split.sampled == 5


def test_records_a_shard_gains_while_it_is_read_are_neither_trained_on_nor_counted(tmp_path, monkeypatch):
    """The capture appends to the current hour's shard while the source reads it: a record written between the
    index and the copy is neither trained on nor counted, so every count describes one set of records."""
    import dfp_adapt.source as capture_source

    written = write_capture(f"file://{tmp_path}/capture")
    store = open_store(f"file://{tmp_path}/capture")
    key = f"completions/{T0:%Y%m%dT%H}/w1-b-000001.jsonl"
    late = record(77, T0 + timedelta(minutes=59), greedy=True)
    reads = {"n": 0}
    real_lines = capture_source._lines

    def lines_then_append(src, k):
        if k == key:
            reads["n"] += 1
            if reads["n"] == 2:
                store.put(key, store.get(key) + encode_records([late]))
        return real_lines(src, k)

    monkeypatch.setattr(capture_source, "_lines", lines_then_append)
    split = prepare_source(f"file://{tmp_path}/capture", f"file://{tmp_path}/run", T0, T0 + timedelta(hours=3),
                           heldout_share=0.2, regenerate=False)
    out = open_store(f"file://{tmp_path}/run")
    ids = {r["id"] for r in lines(out, "data/")} | {p["id"] for p in lines(out, "heldout/")}
    assert reads["n"] == 2 and "r77" not in ids
    assert ids == {r["id"] for r in written if not r["meta"]["incomplete"]}
    assert split.greedy + split.sampled + split.heldout_records == len(ids)


def test_a_window_without_enough_records_is_refused(tmp_path):
    write_capture(f"file://{tmp_path}/capture")
    with pytest.raises(SourceError, match="too few"):
        prepare_source(f"file://{tmp_path}/capture", f"file://{tmp_path}/run", T0 + timedelta(days=2),
                       T0 + timedelta(days=2, hours=1), heldout_share=0.1, regenerate=True)


def test_windows_are_bounded():
    assert window(None, T0, 2.0) == (T0 - timedelta(hours=2), T0)
    assert window_hours(T0 - timedelta(minutes=30), T0 + timedelta(minutes=1)) == ["20260301T09", "20260301T10"]
    for since, until, hours in [(None, T0, None), (None, T0, 0.0), (None, T0, 24 * 32.0), (T0, T0, None),
                                (T0 - timedelta(days=40), T0, None)]:
        with pytest.raises(SourceError):
            window(since, until, hours)
    with pytest.raises(SourceError, match="heldout_share"):
        prepare_source("file:///nowhere", "file:///nowhere", T0, T0 + timedelta(hours=1), heldout_share=0.9,
                       regenerate=True)


def test_a_window_of_long_records_is_read_and_written_in_bounded_memory(tmp_path, monkeypatch):
    """Records as long as clients send them (prompts of hundreds of KB, one line past the bound): the shards are
    streamed line by line, and the split's files are cut by bytes as well as records, so the run's memory holds
    about one record, not a shard or a file of them; the over-long line is counted and the rest kept."""
    import tracemalloc

    import dfp_adapt.source as capture_source

    monkeypatch.setattr(capture_source, "MAX_LINE_BYTES", 1 << 20)
    monkeypatch.setattr(capture_source, "MAX_FILE_BYTES", 2 << 20)
    rows = []
    for i in range(120):
        row = record(i, T0 + timedelta(minutes=i % 60, seconds=i // 60), greedy=i % 2 == 0)
        row["messages"][0]["content"] = f"question {i} " + "x" * 200_000
        rows.append(row)
    long = record(500, T0 + timedelta(minutes=30), greedy=True)
    long["messages"][0]["content"] = "y" * 3_000_000
    store = open_store(f"file://{tmp_path}/capture")
    store.put(f"completions/{T0:%Y%m%dT%H}/w0-b-000001.jsonl", encode_records(rows[:60] + [long] + rows[60:]))

    tracemalloc.start()
    try:
        split = prepare_source(f"file://{tmp_path}/capture", f"file://{tmp_path}/run", T0, T0 + timedelta(hours=1),
                               heldout_share=0.1, regenerate=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert peak < 12 << 20, f"peak {peak / 2**20:.1f} MiB for a 27 MiB shard"
    assert split.dropped["long_line"] == 1
    assert (split.greedy, split.sampled, split.heldout_records) == (54, 54, 12)
    out = open_store(f"file://{tmp_path}/run")
    assert all(len(out.get(k)) <= (2 << 20) + 210_000 for k in out.list("data/"))
    ids = {r["id"] for r in lines(out, "data/")} | {p["id"] for p in lines(out, "regenerate/")} \
        | {p["id"] for p in lines(out, "heldout/")}
    assert ids == {r["id"] for r in rows}
