"""A train job never resumes from, overwrites or deletes another principal's run."""

from __future__ import annotations

import hashlib

import pytest
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.worker import Worker
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler

from tests.trainer.train_support import tiny_spec, torch_threads


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def snapshot(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_another_principals_run_is_not_resumed_overwritten_or_pruned(redis_server, redis_client, tmp_path,
                                                                     tiny_qwen3_dir, tiny_dataset):
    settings = TrainerSettings(redis_url=redis_server.url, device="cpu", progress_every_s=0.01)
    jobs = JobStore(redis_client)
    output = tmp_path / "runs" / "alice-run"

    def run(owner: str, **over) -> str:
        job, _ = queue_job(redis_client, "train", tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{output}", **over),
                           owner=owner)
        Worker(TaskQueue(redis_client, "train", lease_ms=settings.lease_ms), jobs,
               TrainHandler(settings, redis_client), heartbeat_s=0.5).run(max_tasks=1, idle_exit_s=5)
        return job.id

    alice = run("alice", steps=2, checkpoint_every=1, keep_checkpoints=1)
    assert jobs.get(alice).state == JobState.succeeded, jobs.get(alice).error
    before = snapshot(output)
    assert any("checkpoint" in name or "step-" in name for name in before), sorted(before)

    bob = run("bob", steps=4, checkpoint_every=1, keep_checkpoints=1)
    rec = jobs.get(bob)
    assert rec.state == JobState.failed and "belongs to 'alice'" in rec.error, rec.error
    assert snapshot(output) == before  # nothing resumed from, rewritten or deleted
