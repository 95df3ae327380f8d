"""Task queue and job records against a real Redis: exactly-once, redelivery, dead letters, restarts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from dfp_shared.jobs import IllegalTransition, JobState, JobStore
from dfp_shared.queue import TaskQueue
from dfp_shared.redis_conn import connect
from dfp_shared.worker import Worker

from tests.support.cli import cli_env


def consumer(url: str, name: str, **kw) -> subprocess.Popen:
    args = [sys.executable, "-m", "tests.support.queue_consumer", "--redis-url", url, "--consumer", name]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(args, env=cli_env())


def wait_until(pred, timeout=60.0, every=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    raise AssertionError("condition not met in time")


def new_job(r, n, kind="test", payload=None):
    jobs = JobStore(r)
    job, _ = jobs.create(kind, {}, totals={"tasks": n})
    TaskQueue(r, kind).enqueue_many(job.id, [(f"t{i:05d}", dict(payload or {}, i=i)) for i in range(n)])
    return job


def stop_all(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def test_four_consumers_ack_every_task_exactly_once(redis_server, redis_client):
    n_tasks, n_cons = 5000, 4
    job = new_job(redis_client, n_tasks)
    procs = [consumer(redis_server.url, f"c{i}") for i in range(n_cons)]
    try:
        wait_until(lambda: JobStore(redis_client).get(job.id).state == JobState.succeeded, timeout=240)
    finally:
        stop_all(procs)
    handled = redis_client.lrange(f"handled:{job.id}", 0, -1)
    assert len(handled) == n_tasks and len(set(handled)) == n_tasks
    assert TaskQueue(redis_client, "test").pending() == 0
    assert redis_client.xlen("dfp:tasks:test") == 0


def test_killed_consumer_task_is_redelivered_after_lease(redis_server, redis_client):
    job = new_job(redis_client, 1, payload={"sleep": 60})
    victim = consumer(redis_server.url, "victim", lease_ms=1500)
    wait_until(lambda: redis_client.llen(f"attempts:{job.id}") == 1)
    victim.send_signal(signal.SIGKILL)  # dies mid-task, holding the lease
    victim.wait()
    survivor = consumer(redis_server.url, "survivor", lease_ms=1500)
    try:
        wait_until(lambda: JobStore(redis_client).get(job.id).state == JobState.succeeded, timeout=60)
    finally:
        stop_all([survivor])
    assert redis_client.lrange(f"attempts:{job.id}", 0, -1) == ["t00000:victim:1", "t00000:survivor:2"]
    assert redis_client.lrange(f"handled:{job.id}", 0, -1) == ["t00000"]


def test_always_failing_task_is_dead_lettered_with_last_error(redis_client):
    job = new_job(redis_client, 2, payload={})
    TaskQueue(redis_client, "test").enqueue(job.id, "bad", {"fail": True})
    JobStore(redis_client).set_totals(job.id, tasks=3)
    q = TaskQueue(connect(_url(redis_client)), "test", lease_ms=200, max_deliveries=3)
    jobs = JobStore(redis_client)
    attempts = []

    def handle(task, ctx):
        if task.payload.get("fail"):
            attempts.append(task.deliveries)
            raise ValueError("cannot parse line 7 of x.jsonl")
        jobs.complete_task(task.job_id, task.key)

    Worker(q, jobs, handle, consumer="w", block_ms=100).run(idle_exit_s=1.5)
    assert attempts == [1, 2, 3]
    dead = q.dead_letters()
    assert len(dead) == 1 and dead[0]["key"] == "bad" and dead[0]["deliveries"] == "3"
    assert "cannot parse line 7 of x.jsonl" in dead[0]["error"]
    rec = jobs.get(job.id)
    assert rec.state == JobState.failed and "cannot parse line 7" in rec.error


def _url(client) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


def test_redis_restart_mid_job_loses_no_acked_task(redis_aof):
    r = connect(redis_aof.url)
    job = new_job(r, 3000)
    procs = [consumer(redis_aof.url, f"c{i}", lease_ms=3000) for i in range(2)]
    try:
        wait_until(lambda: r.llen(f"handled:{job.id}") > 600, timeout=120)
        redis_aof.restart(hard=True)  # SIGKILL, then start again from the AOF
        wait_until(lambda: JobStore(r).get(job.id).state == JobState.succeeded, timeout=240)
    finally:
        stop_all(procs)
    rec = JobStore(r).get(job.id)
    assert rec.counters["tasks"] == 3000 and rec.counters["items"] == 3000
    assert r.scard(f"dfp:job:{job.id}:done") == 3000


def test_cancelled_job_stops_handing_out_tasks(redis_client):
    jobs = JobStore(redis_client)
    job = new_job(redis_client, 50)
    q = TaskQueue(redis_client, "test")
    seen = []

    def handle(task, ctx):
        seen.append(task.key)
        if len(seen) == 5:
            jobs.cancel(task.job_id)
        ctx.check()

    Worker(q, jobs, handle, consumer="w", block_ms=100).run(idle_exit_s=0.5)
    assert len(seen) == 5
    assert jobs.get(job.id).state == JobState.cancelled
    assert q.pending() == 0  # the rest were acked and skipped, not left behind


def test_job_state_machine_and_progress(redis_client):
    jobs = JobStore(redis_client)
    job, created = jobs.create("tokenize", {"a": 1}, idempotency_key="k1", totals={"tasks": 4})
    again, created2 = jobs.create("tokenize", {"a": 1}, idempotency_key="k1")
    assert created and not created2 and again.id == job.id
    assert jobs.start(job.id) and not jobs.start(job.id)
    assert jobs.complete_task(job.id, "a", samples=10)
    assert not jobs.complete_task(job.id, "a", samples=10)  # counted once
    rec = jobs.get(job.id)
    assert rec.counters == {"tasks": 1, "samples": 10}
    prog = rec.progress()
    assert prog["fraction"] == 0.25 and prog["eta_s"] is not None
    jobs.transition(job.id, JobState.succeeded)
    with pytest.raises(IllegalTransition):
        jobs.cancel(job.id)
    states = [d["state"] for _, t, d in jobs.events(job.id) if t == "state"]
    assert states == ["queued", "running", "succeeded"]
    page, total = jobs.list(state="succeeded")
    assert total == 1 and page[0].id == job.id
