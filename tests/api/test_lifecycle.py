"""The whole job lifecycle through HTTP against real Redis and a real tokenize worker."""

from __future__ import annotations

import json
import threading
import time

from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.records.token_shards import load_dataset
from dfp_shared.storage.store import open_store

from .sse import read_events
from .tokenize_worker import start_worker, write_completions


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_submit_progress_events_completion(api, redis_client, encoders, qwen3_tokenizer_dir, tmp_path):
    completions = write_completions(tmp_path / "completions", files=4, per_file=5)
    output = (tmp_path / "tokens").as_uri()
    worker, thread = start_worker(redis_client, encoders)
    try:
        resp = api.post("/v1/jobs", json={"type": "tokenize", "spec": {
            "input": completions, "output": output, "tokenizer": str(qwen3_tokenizer_dir)}})
        assert resp.status_code == 201
        job_id = resp.json()["id"]
        events = read_events(api, job_id)
    finally:
        worker.stopping.set()
        thread.join(10)

    states = [d["state"] for e, _, d in events if e == "state"]
    assert states == ["queued", "running", "succeeded"]
    ids = [i for e, i, _ in events if e == "state"]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))  # in stream order, with resumable ids
    progress = [d for e, _, d in events if e == "progress"]
    done = [p["progress"]["units"].get("files", {}).get("done", 0) for p in progress]
    assert done == sorted(done) and done[-1] == 4
    assert progress[-1]["progress"]["units"]["files"]["total"] == 4
    end = events[-1]
    assert end[0] == "end" and end[2]["state"] == "succeeded"
    assert end[2]["outputs"]["dataset"].rstrip("/") == output and end[2]["outputs"]["samples"] == 20

    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "succeeded" and job["error"] is None
    assert job["progress"]["fraction"] == 1.0 and job["progress"]["rate_per_s"] > 0
    assert job["progress"]["eta_s"] is None and job["counters"]["samples"] == 20
    manifest = json.loads(open_store(output).get("manifest.json"))
    assert manifest["num_samples"] == 20 and len(manifest["shards"]) == 4
    dataset = load_dataset(output)
    assert len(dataset.sample_ids) == 20 and int(dataset.loss_mask.sum()) > 0

    assert any(e == "planned" and d == {"files": 4} for e, _, d in events)  # the worker's own event, relayed

    # resuming the stream after the last state event replays nothing but the final summary
    last_state_id = ids[-1]
    resumed = read_events(api, job_id, headers={"Last-Event-ID": last_state_id})
    assert [e for e, _, _ in resumed] == ["progress", "end"]


def test_cancel_mid_job(api, redis_client, encoders, qwen3_tokenizer_dir, tmp_path):
    completions = write_completions(tmp_path / "completions", files=6, per_file=3)
    output = tmp_path / "tokens"
    gate = threading.Event()
    worker, thread = start_worker(redis_client, encoders, gate=gate)
    try:
        job_id = api.post("/v1/jobs", json={"type": "tokenize", "spec": {
            "input": completions, "output": output.as_uri(), "tokenizer": str(qwen3_tokenizer_dir)}}).json()["id"]
        # planned and the first file task in hand (waiting at the gate)
        _wait(lambda: api.get(f"/v1/jobs/{job_id}").json()["totals"].get("files") == 6
              and redis_client.xpending("dfp:tasks:tokenize", "workers")["pending"] >= 1)
        running = api.get(f"/v1/jobs/{job_id}").json()
        assert running["state"] == "running" and running["progress"]["eta_s"] is None
        cancelled = api.post(f"/v1/jobs/{job_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        gate.set()
        queue = TaskQueue(redis_client, "tokenize")
        _wait(lambda: queue.lag() == 0 and queue.pending() == 0)
    finally:
        gate.set()
        worker.stopping.set()
        thread.join(10)
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "cancelled" and job["counters"].get("files", 0) == 0
    assert not output.exists() or not any(output.rglob("*.safetensors"))
    events = read_events(api, job_id)
    assert [d["state"] for e, _, d in events if e == "state"] == ["queued", "running", "cancelled"]
    assert events[-1][2]["state"] == "cancelled"
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 409
