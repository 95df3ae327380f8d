"""Generate jobs end to end on real Redis: plan -> shard tasks -> finalize, reruns, cancel, a killed worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from dfp_generation.settings import GenerationSettings
from dfp_generation.tasks import GenerationHandler, GenerationWorker
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.records.completions import read_manifest
from dfp_shared.storage.store import open_store

from tests.support.servers import free_port

from .conftest import read_jsonl, write_jsonl
from .openai_server import LoopbackOpenAI

ROOT = Path(__file__).resolve().parents[2]


def make_prompts(path: Path, n: int, faults: dict[int, str] | None = None, bad_lines: tuple[int, ...] = ()) -> set[str]:
    rows, ids = [], set()
    for i in range(n):
        if i in bad_lines:
            rows.append("{broken")
            continue
        rows.append({"id": f"q{i:03d}", "prompt": f"question {i}" + (faults or {}).get(i, "")})
        ids.add(f"q{i:03d}")
    write_jsonl(path, rows)
    return ids


def settings_for(redis_server, **extra) -> GenerationSettings:
    return GenerationSettings(redis_url=redis_server.url, backoff_base_s=0.01, backoff_max_s=0.05, lease_ms=2000,
                              checkpoint_interval_s=0.2, **extra)


def run_worker(redis_client, settings, idle_exit_s=1.5) -> int:
    return GenerationWorker(GenerationHandler(redis_client, settings), block_ms=200).run(idle_exit_s=idle_exit_s)


def collect(store, prefix: str) -> list[dict]:
    return [row for key in store.list(prefix) for row in read_jsonl_bytes(store.get(key))]


def read_jsonl_bytes(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def test_job_to_s3_counts_progress_and_rerun_skips(tmp_path, redis_server, redis_client, s3_bucket, s3_server,
                                                   openai_server):
    ids = make_prompts(tmp_path / "prompts.jsonl", 11, faults={3: "[[always500]]", 5: "[[429x1]]"}, bad_lines=(7,))
    spec = {"prompts": str(tmp_path / "prompts.jsonl"), "output": f"{s3_bucket}/gen", "engine": "openai",
            "openai_model": "target", "shard_size": 4, "concurrency": 3,
            "max_retries": 2}
    settings = settings_for(redis_server, s3_endpoint_url=s3_server.endpoint_url, openai_base_url=openai_server.base_url)
    job, _ = queue_job(redis_client, "generate", spec)
    run_worker(redis_client, settings)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.succeeded, rec.error
    assert rec.outputs["completions"] == f"{s3_bucket}/gen/completions/"
    assert rec.totals["prompts"] == 10 and rec.totals["shards"] == 3 and rec.totals["unreadable"] == 1
    assert rec.counters["prompts"] == 10 and rec.counters["completions"] == 9 and rec.counters["errors"] == 1
    assert rec.counters["output_tokens"] > 0
    progress = rec.progress()
    assert progress["fraction"] == 1.0 and progress["units"]["output_tokens"]["rate_per_s"] > 0
    events = [t for _, t, _ in JobStore(redis_client).events(job.id, count=1000)]
    assert "planned" in events and events.count("shard_done") == 3

    store = open_store(f"{s3_bucket}/gen", endpoint_url=s3_server.endpoint_url)
    records = collect(store, "completions/")
    errors = collect(store, "errors/")
    assert sorted(r["id"] for r in records) == sorted(ids - {"q003"})
    assert [e["id"] for e in errors if "id" in e] == ["q003"]
    assert [(e["line"], e["kind"]) for e in errors if "id" not in e] == [(8, "unreadable_prompt")]
    manifest = read_manifest(store)
    assert manifest["completions"] == 9 and len(manifest["shards"]) == 3
    assert not list(store.list("partial/"))

    # the same spec again into the same output: every shard is skipped, nothing is regenerated
    served = openai_server.status_counts[200]
    job2, _ = queue_job(redis_client, "generate", spec)
    run_worker(redis_client, settings)
    rec2 = JobStore(redis_client).get(job2.id)
    assert rec2.state == JobState.succeeded and rec2.counters["completions"] == 9
    assert openai_server.status_counts[200] == served
    assert sorted(r["id"] for r in collect(store, "completions/")) == sorted(ids - {"q003"})


def test_job_fails_fast_on_a_spec_it_cannot_run(tmp_path, redis_server, redis_client):
    make_prompts(tmp_path / "p.jsonl", 2)
    job, _ = queue_job(redis_client, "generate", {"prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "o"),
                                                  "engine": "openai"})
    run_worker(redis_client, settings_for(redis_server), idle_exit_s=0.5)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.failed and "DFLASH_OPENAI_BASE_URL" in rec.error
    job, _ = queue_job(redis_client, "generate", {"prompts": str(tmp_path / "nothing-here"),
                                                  "output": str(tmp_path / "o"), "model": str(tmp_path)})
    run_worker(redis_client, settings_for(redis_server), idle_exit_s=0.5)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.failed and "no prompt files" in rec.error


def test_cancel_stops_a_running_shard(tmp_path, redis_server, redis_client):
    server = LoopbackOpenAI(latency=0.3).start()
    try:
        make_prompts(tmp_path / "p.jsonl", 40)
        job, _ = queue_job(redis_client, "generate", {
            "prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "o"), "engine": "openai",
            "openai_model": "m", "shard_size": 40, "concurrency": 1})
        worker = GenerationWorker(GenerationHandler(redis_client, settings_for(redis_server, openai_base_url=server.base_url)),
                                  block_ms=200)
        thread = threading.Thread(target=worker.run, kwargs={"idle_exit_s": 1.0})
        thread.start()
        jobs = JobStore(redis_client)
        deadline = time.monotonic() + 30
        while server.status_counts[200] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        jobs.cancel(job.id)
        thread.join(30)
        assert not thread.is_alive()
        assert jobs.get(job.id).state == JobState.cancelled
        assert server.status_counts[200] < 40
        assert not (tmp_path / "o" / "completions" / "shard-00000.jsonl").exists()
    finally:
        server.stop()


def _worker_proc(redis_url: str, log_path: Path, openai_url: str, metrics_port: int = 0) -> subprocess.Popen:
    env = {**os.environ, "DFLASH_METRICS_PORT": str(metrics_port), "PYTHONPATH": str(ROOT / "services") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "DFLASH_REDIS_URL": redis_url, "DFLASH_LEASE_MS": "1500", "DFLASH_CHECKPOINT_INTERVAL_S": "0.2",
           "DFLASH_BACKOFF_BASE_S": "0.01", "DFLASH_BACKOFF_MAX_S": "0.05", "DFLASH_OPENAI_BASE_URL": openai_url}
    return subprocess.Popen([sys.executable, "-m", "dfp_cli.main", "generation", "worker", "--idle-exit-s", "3"],
                            env=env, cwd=str(ROOT), stdout=log_path.open("ab"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_worker_killed_mid_shard_job_completes_with_every_prompt_once(tmp_path, redis_server, redis_client):
    server = LoopbackOpenAI(latency=0.1).start()
    try:
        ids = make_prompts(tmp_path / "p.jsonl", 36, faults={4: "[[always500]]", 20: "[[500x1]]", 30: "[[429x1]]"})
        job, _ = queue_job(redis_client, "generate", {
            "prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "out"), "engine": "openai",
            "openai_model": "m", "shard_size": 12, "concurrency": 2,
            "max_retries": 2})
        jobs = JobStore(redis_client)
        log = tmp_path / "worker.log"
        first = _worker_proc(redis_server.url, log, server.base_url)
        partial = tmp_path / "out" / "partial"
        deadline = time.monotonic() + 90
        # kill it once a shard is done and another is half-way (its checkpoint is on disk)
        while time.monotonic() < deadline:
            if jobs.get(job.id).counters.get("shards", 0) >= 1 and partial.is_dir() and any(partial.iterdir()):
                break
            assert first.poll() is None, log.read_text()
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert jobs.get(job.id).state == JobState.running
        port = free_port()
        second = _worker_proc(redis_server.url, log, server.base_url, metrics_port=port)
        while time.monotonic() < deadline and not jobs.get(job.id).state.terminal:
            time.sleep(0.1)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'dfp_generation_completions_total{engine="openai"}' in metrics
        second.send_signal(signal.SIGTERM)
        second.wait(20)
        rec = jobs.get(job.id)
        assert rec.state == JobState.succeeded, (rec.error, log.read_text()[-3000:])
        records = [r for f in sorted((tmp_path / "out" / "completions").iterdir()) for r in read_jsonl(f)]
        errors = [e for f in sorted((tmp_path / "out" / "errors").iterdir()) for e in read_jsonl(f)]
        out_ids = [r["id"] for r in records] + [e["id"] for e in errors]
        assert sorted(out_ids) == sorted(ids), "every prompt exactly once in the output or the errors"
        assert [e["id"] for e in errors] == ["q004"]
        assert rec.counters["prompts"] == 36 and rec.counters["completions"] == 35 and rec.counters["shards"] == 3
        assert not any(partial.iterdir())
        text = log.read_text()
        assert "reclaimed task" in text and "resuming shard from checkpoint" in text, text[-3000:]
    finally:
        server.stop()


def test_pipeline_generate_output_feeds_the_tokenizer_unchanged(tmp_path, redis_server, redis_client, openai_server,
                                                               tiny_qwen3_dir):
    from dfp_tokenizer.pool import run_process
    from dfp_tokenizer.settings import TokenizerSettings

    make_prompts(tmp_path / "p.jsonl", 6, bad_lines=(2,))
    pipeline, _ = queue_job(redis_client, "pipeline", {
        "generate": {"prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "gen"), "engine": "openai",
                     "openai_model": "m", "shard_size": 2,
                     "samples_per_prompt": 2},
        "tokenize": {"output": str(tmp_path / "tok"), "tokenizer": str(tiny_qwen3_dir)},
        "train": {"target": str(tiny_qwen3_dir), "output": str(tmp_path / "train")},
    })
    run_worker(redis_client, settings_for(redis_server, openai_base_url=openai_server.base_url))
    jobs = JobStore(redis_client)
    rec = jobs.get(pipeline.id)
    gen = jobs.get(rec.outputs["generate_job"])
    assert gen.state == JobState.succeeded and gen.counters["completions"] == 10
    tokenize = jobs.get(rec.outputs["tokenize_job"])
    assert tokenize.spec["input"] == f"{tmp_path}/gen/completions/"
    thread = threading.Thread(target=run_process, args=(TokenizerSettings(redis_url=redis_server.url, threads=1),),
                              kwargs={"idle_exit_s": 2.0})
    thread.start()
    thread.join(120)
    tokenize = jobs.get(tokenize.id)
    assert tokenize.state == JobState.succeeded, tokenize.error
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    assert manifest["num_samples"] == 10
    assert not (tmp_path / "tok" / "errors").exists()  # no line of the completion shards was rejected
    assert tokenize.counters.get("bad_lines", 0) == 0
    assert "train_job" in jobs.get(pipeline.id).outputs


def test_shutdown_checkpoints_and_releases_the_shard_for_another_worker(tmp_path, redis_server, redis_client):
    server = LoopbackOpenAI(latency=0.1).start()
    try:
        ids = make_prompts(tmp_path / "p.jsonl", 30)
        job, _ = queue_job(redis_client, "generate", {
            "prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "o"), "engine": "openai",
            "openai_model": "m", "shard_size": 30, "concurrency": 1})
        settings = settings_for(redis_server, openai_base_url=server.base_url)
        first = GenerationWorker(GenerationHandler(redis_client, settings), block_ms=200)
        thread = threading.Thread(target=first.run, kwargs={"idle_exit_s": 1.0})
        thread.start()
        deadline = time.monotonic() + 30
        while server.status_counts[200] < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        first.stopping.set()  # what SIGTERM does
        thread.join(30)
        served = server.status_counts[200]
        assert not thread.is_alive() and served < 30
        partial = read_jsonl(tmp_path / "o" / "partial" / "shard-00000.jsonl")
        assert len(partial) - 1 >= 5  # header + the results finished before the shutdown
        # released, not waiting out its lease: the next worker takes it at once and resumes
        run_worker(redis_client, settings)
        rec = JobStore(redis_client).get(job.id)
        assert rec.state == JobState.succeeded
        assert sorted(r["id"] for r in read_jsonl(tmp_path / "o" / "completions" / "shard-00000.jsonl")) == sorted(ids)
        assert server.status_counts[200] - served <= 30 - (len(partial) - 1)
    finally:
        server.stop()


def test_transformers_job_through_the_worker(tmp_path, redis_server, redis_client, tiny_qwen3_dir):
    """The embedded default (what the demo runs): a tiny Qwen3 in the worker process, on the CPU."""
    import torch

    ids = make_prompts(tmp_path / "p.jsonl", 3)
    job, _ = queue_job(redis_client, "generate", {
        "prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "o"), "model": str(tiny_qwen3_dir),
        "max_new_tokens": 4, "temperature": 0, "shard_size": 2})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_worker(redis_client, settings_for(redis_server, device="cpu", generation_batch_size=2))
    finally:
        torch.set_num_threads(threads)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.succeeded, rec.error
    records = [r for f in sorted((tmp_path / "o" / "completions").iterdir()) for r in read_jsonl(f)]
    assert sorted(r["id"] for r in records) == sorted(ids)
    assert all(r["meta"]["engine"] == "transformers" and r["meta"]["completion_tokens"] <= 4 for r in records)
    assert rec.counters["output_tokens"] == sum(r["meta"]["completion_tokens"] for r in records)
