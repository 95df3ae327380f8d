"""A job that can never succeed fails at once with its reason, never retried: a refused model (weights only
as a pickle), a spec the worker rejects."""

from __future__ import annotations

import json

from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.jobs.worker import Worker


def _pickled_only_model(root):
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (root / "pytorch_model.bin").write_bytes(b"not loaded")
    return root


def test_a_model_with_only_pickled_weights_fails_its_job_at_once(redis_client, tmp_path):
    from dfp_shared.models.loading import load_causal_lm

    model = _pickled_only_model(tmp_path / "model")
    job, _ = queue_job(redis_client, "tokenize", {"input": str(tmp_path), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(model)})
    deliveries = []

    def handler(task, ctx):  # what a worker loading the job's target does
        deliveries.append(task.deliveries)
        load_causal_lm(str(model), device="cpu")

    queue = TaskQueue(redis_client, TOKENIZE.stream, lease_ms=2000, max_deliveries=5)
    Worker(queue, JobStore(redis_client), handler, block_ms=50).run(idle_exit_s=1.0)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "failed"
    assert "pytorch_model.bin" in rec.error and "safetensors" in rec.error, rec.error
    assert deliveries == [1]
    assert queue.dead_letters() == []


def test_a_tokenize_spec_the_worker_rejects_fails_its_job_at_once(redis_client, tmp_path):
    from dfp_tokenizer.limits import EncodeLimits
    from dfp_tokenizer.tasks import EncoderCache, TokenizeHandler

    job, _ = queue_job(redis_client, "tokenize", {"input": str(tmp_path), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(tmp_path)})
    # a spec that no longer validates (written straight into Redis, or from an older version)
    spec = {**JobStore(redis_client).get(job.id).spec, "samples_per_batch": 0}
    redis_client.hset(JobStore.keys(job.id).record, "spec", json.dumps(spec))
    queue = TaskQueue(redis_client, TOKENIZE.stream, lease_ms=2000, max_deliveries=5)
    Worker(queue, JobStore(redis_client), TokenizeHandler(redis_client, EncoderCache(limits=EncodeLimits())),
           block_ms=50).run(idle_exit_s=1.0)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "failed" and rec.error.startswith("invalid tokenize spec"), rec.error
    assert queue.dead_letters() == []
