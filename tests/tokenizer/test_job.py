"""Tokenize jobs end to end on real Redis: bad lines, unreadable files, progress, the dataset."""

from __future__ import annotations

import gzip
import json

from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.jobs.worker import Worker
from dfp_shared.records.token_shards import load_dataset
from dfp_shared.storage.store import open_store
from dfp_tokenizer.files import shard_name
from dfp_tokenizer.tasks import EncoderCache, TokenizeHandler, TokenizeWorker

from .corpus import jsonl, records


def run_until_idle(r, max_deliveries: int = 3) -> Worker:
    queue = TaskQueue(r, TOKENIZE.stream, lease_ms=5000, max_deliveries=max_deliveries)
    worker = Worker(queue, JobStore(r), TokenizeHandler(r, EncoderCache()), block_ms=100)
    worker.run(idle_exit_s=1.0)
    return worker


BAD = [
    ("{not json", "malformed_json"),
    ('"just a string"', "not_an_object"),
    ('{"id": "e1", "messages": []}', "empty_conversation"),
    ('{"id": "e2", "messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}',
     "unknown_role"),
    ('{"id": "e3", "messages": [{"role": "user", "content": "only a question"}]}', "no_assistant_turn"),
    (json.dumps({"id": "e4", "messages": [{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "long " * 5000}]}), "too_long"),
]


def test_bad_lines_are_reported_and_good_samples_kept(redis_client, tmp_path, qwen3_tokenizer_dir):
    good = records(30, seed=1)
    lines = [json.dumps(r) for r in good[:10]]
    bad_at = {}
    for raw, reason in BAD:
        lines.append(raw)
        bad_at[len(lines)] = reason
    lines += [json.dumps(r) for r in good[10:20]]
    inp = tmp_path / "in"
    (inp / "nested").mkdir(parents=True)
    (inp / "a.jsonl").write_text("\n".join(lines) + "\n")
    (inp / "nested" / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(good[20:])))
    (inp / "ignored.txt").write_text("not an input")
    out = tmp_path / "out"
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(out),
                                                  "tokenizer": str(qwen3_tokenizer_dir), "max_length": 4096})
    run_until_idle(redis_client)

    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "succeeded", rec.error
    assert rec.counters["files"] == 2 and rec.counters["samples"] == 30 and rec.counters["bad_lines"] == len(BAD)
    prog = rec.progress()
    assert prog["units"]["tokens"]["rate_per_s"] > 0 and prog["units"]["files"]["fraction"] == 1.0
    assert rec.outputs["dataset"].endswith("/out")

    errors = [json.loads(x) for x in (out / "errors" / f"{shard_name('a.jsonl')}.jsonl").read_text().splitlines()]
    assert {e["line"]: e["reason"] for e in errors} == bad_at
    assert all(e["file"].endswith("/in/a.jsonl") and e["detail"] for e in errors)
    assert not (out / "errors" / f"{shard_name('nested/b.jsonl.gz')}.jsonl").exists()

    stats = json.loads((out / "stats.json").read_text())
    assert stats["errors_by_reason"] == {reason: 1 for _, reason in BAD}
    assert stats["samples"] == 30 and sum(b["count"] for b in stats["length_histogram"]) == 30
    ds = load_dataset(str(out))
    assert sorted(ds.sample_ids) == sorted(r["id"] for r in good)
    assert ds.manifest["num_trained_tokens"] == int(ds.loss_mask.sum()) > 0
    assert len(ds.manifest["shards"]) == 2


def test_unreadable_file_fails_its_task_then_the_job(redis_client, tmp_path, qwen3_tokenizer_dir):
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "ok.jsonl").write_bytes(jsonl(records(5)))
    (inp / "broken.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage-not-gzip")
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(qwen3_tokenizer_dir)})
    run_until_idle(redis_client, max_deliveries=2)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "failed"
    assert "broken.jsonl.gz" in rec.error and "gzip" in rec.error and "2 times" in rec.error
    dead = TaskQueue(redis_client, TOKENIZE.stream).dead_letters()
    assert [d["key"] for d in dead] == ["broken.jsonl.gz"]


def test_empty_input_prefix_fails_clearly(redis_client, tmp_path, qwen3_tokenizer_dir):
    (tmp_path / "in").mkdir()
    job, _ = queue_job(redis_client, "tokenize", {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(qwen3_tokenizer_dir)})
    run_until_idle(redis_client)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "failed" and "no input files" in rec.error


def test_tokenizer_directory_on_object_storage(redis_client, s3_server, s3_bucket, tmp_path, qwen3_tokenizer_dir,
                                               monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    store = open_store(s3_bucket)
    for f in qwen3_tokenizer_dir.iterdir():
        store.put(f"tok/{f.name}", f.read_bytes())
    store.put("in/c.jsonl", jsonl(records(12, seed=3)))
    job, _ = queue_job(redis_client, "tokenize", {"input": f"{s3_bucket}/in/", "output": f"{s3_bucket}/out",
                                                  "tokenizer": f"{s3_bucket}/tok", "thinking": False})
    queue = TaskQueue(redis_client, TOKENIZE.stream, lease_ms=5000)
    handler = TokenizeHandler(redis_client, EncoderCache(s3_server.endpoint_url, str(tmp_path / "cache")),
                              s3_server.endpoint_url)
    Worker(queue, JobStore(redis_client), handler, block_ms=100).run(idle_exit_s=1.0)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "succeeded", rec.error
    ds = load_dataset(f"{s3_bucket}/out", endpoint_url=s3_server.endpoint_url)
    assert ds.num_samples == 12 and list((tmp_path / "cache" / "tokenizers").iterdir())


def test_worker_dying_between_counting_the_last_file_and_queueing_finalize(redis_client, tmp_path,
                                                                           qwen3_tokenizer_dir, monkeypatch):
    """The last file is counted, then its worker fails before ``finalize`` is queued: the redelivered
    (already counted) task must still lead to ``finalize`` and a finished job."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "only.jsonl").write_bytes(jsonl(records(4)))
    job, _ = queue_job(redis_client, "tokenize", {"input": str(tmp_path / "in"), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(qwen3_tokenizer_dir)})
    real_enqueue = TaskQueue.enqueue
    calls = []

    def dying_enqueue(self, job_id, key, payload):
        if key == "finalize" and not calls:
            calls.append(key)
            raise ConnectionError("worker lost its connection right after counting the file")
        return real_enqueue(self, job_id, key, payload)

    monkeypatch.setattr(TaskQueue, "enqueue", dying_enqueue)
    queue = TaskQueue(redis_client, TOKENIZE.stream, lease_ms=5000)
    TokenizeWorker(queue, JobStore(redis_client), TokenizeHandler(redis_client, EncoderCache()),
                   block_ms=100).run(idle_exit_s=1.0)
    rec = JobStore(redis_client).get(job.id)
    assert calls == ["finalize"]
    assert rec.state.value == "succeeded", rec.error
    assert rec.counters["files"] == 1 and rec.counters["samples"] == 4
