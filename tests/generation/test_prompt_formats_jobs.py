"""Generation over JSON arrays and Parquet files: shards by record index or row range, each record
counted once (a prompt, or an unreadable record at its place), end to end through a real job."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from dfp_generation.plan import plan_shards
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.records.completions import read_manifest
from dfp_shared.records.prompts import Prompt, PromptError, iter_prompts
from dfp_shared.storage.store import open_store

from .conftest import write_jsonl
from .test_jobs import collect, run_worker, settings_for


def sharegpt(i: int) -> dict:
    return {"id": f"s{i:03d}", "conversations": [{"from": "human", "value": f"question {i}"},
                                                 {"from": "gpt", "value": f"answer {i}"}]}


def truncated_array(path: Path, n: int, bad: tuple[int, ...] = ()) -> tuple[set[str], int]:
    """``n`` whole records (those in ``bad`` of the wrong shape), then one cut off; returns the ids and size."""
    rows = [{"id": f"s{i:03d}", "conversations": 7} if i in bad else sharegpt(i) for i in range(n + 1)]
    data = json.dumps(rows, indent=2).encode()
    cut = data[: data.rindex(b'"question')]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cut)
    return {f"s{i:03d}" for i in range(n) if i not in bad}, len(cut)


def parquet_set(path: Path, n: int, bad: tuple[int, ...] = (), row_group_size: int = 3) -> set[str]:
    rows = [{"id": f"r{i:03d}", "prompt": None if i in bad else f"question {i}"} for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return {f"r{i:03d}" for i in range(n) if i not in bad}


def read_plan(plan) -> tuple[list[Prompt], list[PromptError]]:
    store = open_store(plan.source.root)
    prompts, errors = [], []
    for shard in plan.shards:
        for seg in shard.segments:
            for item in iter_prompts(store, seg["file"], seg["start"], seg["end"], fmt=seg.get("format", "lines")):
                (prompts if isinstance(item, Prompt) else errors).append(item)
    return prompts, errors


def test_plan_splits_an_array_by_record_range_and_counts_each_record_once(tmp_path):
    ids, size = truncated_array(tmp_path / "set" / "sharegpt.json", 10, bad=(4,))
    write_jsonl(tmp_path / "set" / "more.jsonl", [{"id": "j0", "prompt": "x"}, "{bad"])
    plan = plan_shards(str(tmp_path / "set"), shard_size=4)
    assert plan.prompts == 10 and plan.bad_lines == 3  # record 4, the cut record 10, the bad JSONL line
    assert [s.prompts for s in plan.shards] == [4, 4, 2]
    segs = [seg for s in plan.shards for seg in s.segments]
    assert segs[0] == {"file": "more.jsonl", "start": 1, "end": 3}  # JSON Lines segments are as they were
    assert [(seg["start"], seg["end"], seg["format"]) for seg in segs[1:]] == [
        (0, 3, "json_array"), (3, 8, "json_array"), (8, 11, "json_array")]
    prompts, errors = read_plan(plan)
    assert sorted(p.id for p in prompts) == sorted(ids | {"j0"})
    assert sorted((e.file.rsplit("/", 1)[-1], e.unit, e.line) for e in errors) == [
        ("more.jsonl", "line", 2), ("sharegpt.json", "record", 4), ("sharegpt.json", "record", 10)]
    cut_error = next(e for e in errors if e.line == 10)
    assert f"ends at byte {size} mid-record" in cut_error.reason


def test_plan_splits_parquet_by_row_range(tmp_path):
    ids = parquet_set(tmp_path / "p.parquet", 10, bad=(5,))
    plan = plan_shards(str(tmp_path / "p.parquet"), shard_size=3)
    assert plan.prompts == 9 and plan.bad_lines == 1 and [s.prompts for s in plan.shards] == [3, 3, 3]
    prompts, errors = read_plan(plan)
    assert sorted(p.id for p in prompts) == sorted(ids)
    assert [(e.unit, e.line) for e in errors] == [("row", 5)]


def run_job(tmp_path, redis_server, redis_client, openai_server, prompts: str, shard_size: int):
    out = tmp_path / "out"
    spec = {"prompts": prompts, "output": str(out), "engine": "openai", "openai_model": "target",
            "shard_size": shard_size, "concurrency": 2, "max_retries": 1}
    job, _ = queue_job(redis_client, "generate", spec)
    run_worker(redis_client, settings_for(redis_server, openai_base_url=openai_server.base_url))
    return JobStore(redis_client).get(job.id), open_store(str(out))


def test_job_over_a_truncated_json_array(tmp_path, redis_server, redis_client, openai_server):
    ids, size = truncated_array(tmp_path / "sharegpt.json", 9, bad=(2,))
    rec, store = run_job(tmp_path, redis_server, redis_client, openai_server, str(tmp_path / "sharegpt.json"), 3)
    assert rec.state == JobState.succeeded, rec.error
    assert rec.totals["prompts"] == 8 and rec.totals["unreadable"] == 2 and rec.totals["shards"] == 3
    assert rec.counters["completions"] == 8 and rec.counters["unreadable"] == 2
    records = collect(store, "completions/")
    assert sorted(r["id"] for r in records) == sorted(ids)
    assert {r["meta"]["source"]["file"] for r in records} == {"sharegpt.json"}
    assert sorted(r["meta"]["source"]["record"] for r in records) == [0, 1, 3, 4, 5, 6, 7, 8]
    errors = collect(store, "errors/")
    assert sorted((e["record"], e["kind"]) for e in errors) == [(2, "unreadable_prompt"), (9, "unreadable_prompt")]
    assert any(f"ends at byte {size} mid-record" in e["error"] for e in errors)
    assert read_manifest(store)["completions"] == 8


def test_job_over_a_parquet_file(tmp_path, redis_server, redis_client, openai_server):
    ids = parquet_set(tmp_path / "in" / "p.parquet", 7, bad=(0,), row_group_size=2)
    (tmp_path / "in" / "broken.parquet").write_bytes(b"PAR1 nope")
    rec, store = run_job(tmp_path, redis_server, redis_client, openai_server, str(tmp_path / "in"), 4)
    assert rec.state == JobState.succeeded, rec.error
    assert rec.totals["prompts"] == 6 and rec.totals["unreadable"] == 2
    assert rec.counters["completions"] == 6 and rec.counters["unreadable"] == 2
    assert sorted(r["id"] for r in collect(store, "completions/")) == sorted(ids)
    errors = collect(store, "errors/")
    assert sorted((e["file"].rsplit("/", 1)[-1], e["row"]) for e in errors) == [("broken.parquet", 0), ("p.parquet", 0)]
