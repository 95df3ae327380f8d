"""A running shard's progress in the job record: it moves before the shard completes, and the final
counts stay exact, also when a shard is taken over from a worker that died mid-shard."""

from __future__ import annotations

import threading
import time

from dfp_generation.engines import GenResult
from dfp_generation.live import ShardProgress
from dfp_generation.settings import GenerationSettings
from dfp_generation.tasks import GenerationHandler, GenerationWorker
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.types import GENERATE

from .conftest import read_jsonl
from .openai_server import LoopbackOpenAI
from .test_jobs import make_prompts, run_worker, settings_for

PROMPTS = 8


def one_shard_job(tmp_path, redis_client, server) -> str:
    make_prompts(tmp_path / "p.jsonl", PROMPTS)
    job, _ = queue_job(redis_client, "generate", {
        "prompts": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "o"), "engine": "openai",
        "openai_model": "m", "shard_size": PROMPTS, "concurrency": 1})
    return job.id


def written_tokens(tmp_path) -> int:
    return sum(r["meta"]["completion_tokens"] for r in read_jsonl(tmp_path / "o" / "completions" / "shard-00000.jsonl"))


def assert_exact(redis_client, job_id: str, tmp_path) -> None:
    rec = JobStore(redis_client).get(job_id)
    assert rec.state == JobState.succeeded, rec.error
    assert rec.counters["prompts"] == PROMPTS and rec.counters["completions"] == PROMPTS
    assert rec.counters["shards"] == 1 and rec.counters["tasks"] == 2 and rec.counters.get("errors", 0) == 0
    assert rec.counters["output_tokens"] == written_tokens(tmp_path)
    assert not redis_client.exists(f"dfp:job:{job_id}:live")


def test_progress_moves_while_the_shard_runs_and_ends_exact(tmp_path, redis_server, redis_client):
    server = LoopbackOpenAI(latency=0.2).start()
    try:
        job_id = one_shard_job(tmp_path, redis_client, server)
        worker = GenerationWorker(GenerationHandler(redis_client, settings_for(redis_server, progress_interval_s=0.1,
                                                                           openai_base_url=server.base_url)),
                                  block_ms=200)
        thread = threading.Thread(target=worker.run, kwargs={"idle_exit_s": 1.0})
        thread.start()
        jobs = JobStore(redis_client)
        seen = []  # progress of the record while its only shard is not counted yet
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rec = jobs.get(job_id)
            if rec.state.terminal:
                break
            if rec.counters.get("shards", 0) == 0:
                seen.append((rec.counters.get("prompts", 0), rec.progress()))
            time.sleep(0.02)
        thread.join(30)
        assert not thread.is_alive()

        done = [n for n, _ in seen]
        assert done == sorted(done) and max(done) <= PROMPTS
        partial = [(n, p) for n, p in seen if 0 < n < PROMPTS]
        assert partial, f"no partial progress seen: {sorted(set(done))}"
        n, progress = partial[-1]
        prompts = progress["units"]["prompts"]
        assert prompts["done"] == n and prompts["total"] == PROMPTS and 0 < progress["fraction"] < 1
        assert progress["units"]["completions"]["done"] == n
        assert progress["units"]["output_tokens"]["done"] > 0 and progress["units"]["output_tokens"]["rate_per_s"] > 0
        assert progress["rate_per_s"] > 0 and progress["eta_s"] > 0
        assert_exact(redis_client, job_id, tmp_path)
    finally:
        server.stop()


def test_a_shard_taken_over_from_a_dead_worker_is_not_counted_twice(tmp_path, redis_server, redis_client):
    server = LoopbackOpenAI(latency=0.05).start()
    try:
        job_id = one_shard_job(tmp_path, redis_client, server)
        settings = GenerationSettings(**{**settings_for(redis_server, openai_base_url=server.base_url).model_dump(),
                                         "lease_ms": 1000,
                                         "progress_interval_s": 0})
        GenerationWorker(GenerationHandler(redis_client, settings), block_ms=200).run(max_tasks=1)  # the plan
        # a worker claims the shard, reports 3 prompts done, and dies (its task stays pending)
        [task] = TaskQueue(redis_client, GENERATE.stream, lease_ms=1000).claim("dead-worker", block_ms=1000)
        assert task.key == "shard-00000"
        dead = ShardProgress(redis_client, job_id, task.key, 1, every_s=0)
        for i in range(3):
            dead.add(GenResult(f"q{i:03d}", content="a", completion_tokens=5))
        assert dead.publish()
        jobs = JobStore(redis_client)
        assert jobs.get(job_id).counters["prompts"] == 3 and jobs.get(job_id).counters["output_tokens"] == 15

        run_worker(redis_client, settings, idle_exit_s=3.0)  # reclaims the shard once its lease ran out
        assert_exact(redis_client, job_id, tmp_path)
        # the dead attempt (or any late one) cannot add to a shard that is counted
        assert not dead.publish()
        late = ShardProgress(redis_client, job_id, task.key, 1)
        late.add(GenResult("q000", completion_tokens=5))
        assert not late.publish() and not late.complete(prompts=1, shards=1)
        assert_exact(redis_client, job_id, tmp_path)
    finally:
        server.stop()


def test_only_the_newest_attempt_counts_and_samples_make_a_prompt(redis_client):
    jobs = JobStore(redis_client)
    job, _ = jobs.create("generate", {}, primary_unit="prompts", totals={"prompts": 4})
    first = ShardProgress(redis_client, job.id, "shard-00000", 2, every_s=0)
    first.add(GenResult("a#0", completion_tokens=3))
    first.add(GenResult("a#1", completion_tokens=4))
    first.add(GenResult("b#0", error="failed"))
    assert first.publish()
    moved = {k: v for k, v in jobs.get(job.id).counters.items() if v}
    assert moved == {"prompts": 1, "completions": 2, "errors": 1, "output_tokens": 7}

    second = ShardProgress(redis_client, job.id, "shard-00000", 2, every_s=0)  # a redelivery takes the shard over
    second.add(GenResult("a#0", completion_tokens=3))
    assert second.publish()
    assert jobs.get(job.id).counters["completions"] == 1 and jobs.get(job.id).counters["prompts"] == 0
    first.add(GenResult("b#1", completion_tokens=9))
    assert not first.publish()  # the stale attempt is ignored
    assert jobs.get(job.id).counters["completions"] == 1

    other = ShardProgress(redis_client, job.id, "shard-00001", 2, every_s=0)
    other.add(GenResult("c#0", completion_tokens=1))
    other.publish()
    assert second.complete(prompts=2, completions=4, errors=0, truncated=0, output_tokens=20, shards=1)
    assert not first.complete(prompts=2, completions=4, errors=0, truncated=0, output_tokens=20, shards=1)
    counters = jobs.get(job.id).counters
    assert counters["prompts"] == 2 and counters["completions"] == 5 and counters["output_tokens"] == 21
    assert counters["shards"] == 1 and counters["tasks"] == 1
