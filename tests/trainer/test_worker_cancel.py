"""Cancelling a running train job: training stops after its current step and the job ends cancelled."""

from __future__ import annotations

import json
import threading
import time

from dfp_api.service import cancel
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.worker import Worker
from dfp_shared.storage.store import open_store
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler

from tests.trainer.train_support import tiny_spec, torch_threads

PLANNED = 400


def test_cancel_mid_train_stops_the_run_and_the_job_ends_cancelled(tmp_path, redis_server, redis_client,
                                                                   tiny_qwen3_dir, tiny_dataset):
    output = f"file://{tmp_path}/out"
    job, _ = queue_job(redis_client, "train", tiny_spec(tiny_dataset, tiny_qwen3_dir, output, steps=PLANNED,
                                                        checkpoint_every=PLANNED, eval_prompts=2))
    settings = TrainerSettings(redis_url=redis_server.url, device="cpu", progress_every_s=0.001)
    jobs = JobStore(redis_client)
    queue = TaskQueue(redis_client, "train", lease_ms=settings.lease_ms)
    worker = Worker(queue, jobs, TrainHandler(settings, redis_client), heartbeat_s=0.5)
    handled: list[int] = []
    with torch_threads(1):
        thread = threading.Thread(target=lambda: handled.append(worker.run(max_tasks=1, idle_exit_s=30)), daemon=True)
        thread.start()
        deadline = time.monotonic() + 600  # a guard against a hang, not a timing assertion
        while jobs.get(job.id).counters.get("steps", 0) < 2:
            assert thread.is_alive() and time.monotonic() < deadline, jobs.get(job.id).error
            time.sleep(0.05)
        cancel(redis_client, "tester", job.id)
        thread.join(timeout=600)
    assert not thread.is_alive() and handled == [1]

    rec = jobs.get(job.id)
    assert rec.state == JobState.cancelled
    states = [e["state"] for _, kind, e in jobs.events(job.id, count=10_000) if kind == "state"]
    assert JobState.succeeded.value not in states and states[-1] == JobState.cancelled.value
    steps = [e["step"] for _, kind, e in jobs.events(job.id, count=10_000) if kind == "progress"]
    assert 2 <= steps[-1] < PLANNED  # stopped soon after the cancel, not at the planned end
    assert rec.counters["steps"] == steps[-1] and rec.totals["steps"] == PLANNED
    ckpts = open_store(output + "/checkpoints")
    assert json.loads(ckpts.get("latest.json"))["step"] == steps[-1]  # the stop wrote its checkpoint
    out = open_store(output)
    assert not out.exists("report.json") and not out.exists("drafter/config.json")  # no finish, no export
    assert "drafter" not in rec.outputs
    assert queue.pending() == 0 and queue.dead_letters() == []  # the task was acked, not retried
