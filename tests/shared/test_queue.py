"""Task queue and job records against a real Redis: exactly-once, redelivery, dead letters, restarts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from dfp_shared.jobs.queue import WORKER_DIED, TaskQueue
from dfp_shared.jobs.redis_conn import connect
from dfp_shared.jobs.store import IllegalTransition, JobState, JobStore
from dfp_shared.jobs.worker import TaskReleased, Worker

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


def test_a_task_whose_worker_died_twice_is_not_handed_to_a_third_and_fails_its_job(redis_server, redis_client):
    """A task that kills its consumer (SIGKILL, as the OOM killer would) gets one more try, not another worker
    after another: the second death dead-letters it and fails the job with the reason."""
    jobs = JobStore(redis_client)
    pipeline, _ = jobs.create("pipeline", {})
    job, _ = jobs.create("test", {}, parent_id=pipeline.id, stage="tokenize", totals={"tasks": 1})
    TaskQueue(redis_client, "test").enqueue(job.id, "t00000", {"hang": 600})
    max_deliveries = 5
    for n in range(1, 3):  # each consumer takes the task and is killed mid-task
        victim = consumer(redis_server.url, f"c{n}", lease_ms=1000, max_deliveries=max_deliveries)
        wait_until(lambda n=n: redis_client.llen(f"attempts:{job.id}") == n)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    last = consumer(redis_server.url, "last", lease_ms=1000, max_deliveries=max_deliveries)
    try:
        wait_until(lambda: jobs.get(job.id).state == JobState.failed)
    finally:
        stop_all([last])
    assert last.returncode == 0
    assert redis_client.lrange(f"attempts:{job.id}", 0, -1) == ["t00000:c1:1", "t00000:c2:2"]
    assert redis_client.llen(f"handled:{job.id}") == 0
    assert jobs.get(job.id).error == ("task 't00000': its worker died (or lost its lease) while running it, twice; "
                                      "it is not handed to another worker; dead-lettered")
    dead = TaskQueue(redis_client, "test").dead_letters()
    assert [(d["key"], d["job_id"], d["deliveries"], d["error"]) for d in dead] == [
        ("t00000", job.id, "2", WORKER_DIED)]
    q = TaskQueue(redis_client, "test")
    assert q.pending() == 0 and redis_client.xlen(q.stream) == 0
    assert not redis_client.exists(q.deaths_key, q.released_key)
    parent = jobs.get(pipeline.id)  # the pipeline waiting on the stage ends too
    assert parent.state == JobState.failed and "t00000" in parent.error


def test_a_task_given_back_cleanly_is_not_counted_as_a_death(redis_client):
    """Released on shutdown, then its worker dies once: still one more try (a release is not a death)."""
    q = TaskQueue(redis_client, "deaths", lease_ms=50, max_deliveries=10)
    q.enqueue("j", "k", {})
    (first,) = q.claim("a", block_ms=10)
    q.release(first)  # a clean give-back (shutdown, a failed attempt)
    (second,) = q.claim("b", block_ms=10)
    assert second.deliveries == 2
    time.sleep(0.1)  # b dies holding it: its lease runs out
    (third,) = q.claim("c", block_ms=10)
    assert third.deliveries == 3  # the one more try after a death
    time.sleep(0.1)  # c dies too
    dead = []
    assert q.claim("d", block_ms=10, on_dead=lambda task, error: dead.append((task.key, error))) == []
    assert dead == [("k", WORKER_DIED)] and q.dead_letters()[0]["error"] == WORKER_DIED


def _polling_clients(r, ignore: set[str]) -> int:
    """Connections (other than those in ``ignore``) whose last command polled a stream."""
    return sum(c["id"] not in ignore and c.get("cmd") in ("xreadgroup", "xautoclaim") for c in r.client_list())


def test_heartbeat_keeps_a_task_longer_than_its_lease(redis_server, redis_client):
    lease_ms = 1500
    earlier = {c["id"] for c in redis_client.client_list()}  # other tests' workers may still be polling
    procs = [consumer(redis_server.url, name, lease_ms=lease_ms) for name in ("a", "b")]
    try:
        wait_until(lambda: _polling_clients(redis_client, earlier) >= 2)
        job = new_job(redis_client, 1, payload={"sleep": 8})  # whichever takes it, the other keeps reclaiming
        wait_until(lambda: redis_client.llen(f"attempts:{job.id}") == 1)
        time.sleep(3 * lease_ms / 1000)  # three leases with the other consumer polling for stale tasks
        [entry] = redis_client.xpending_range("dfp:tasks:test", "workers", min="-", max="+", count=10)
        assert entry["times_delivered"] == 1  # never reclaimed: its heartbeats kept it
        assert redis_client.llen(f"handled:{job.id}") == 0  # still running, past its lease
        wait_until(lambda: JobStore(redis_client).get(job.id).state == JobState.succeeded)
    finally:
        stop_all(procs)
    [attempt] = redis_client.lrange(f"attempts:{job.id}", 0, -1)
    assert attempt.endswith(":1")
    assert redis_client.lrange(f"handled:{job.id}", 0, -1) == ["t00000"]
    q = TaskQueue(redis_client, "test")
    assert q.pending() == 0 and not q.dead_letters()


def test_sigterm_finishes_the_task_in_hand_then_exits(redis_server, redis_client):
    job = new_job(redis_client, 1, payload={"sleep": 3})
    proc = consumer(redis_server.url, "c")
    try:
        wait_until(lambda: redis_client.llen(f"attempts:{job.id}") == 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        stop_all([proc])
    assert redis_client.lrange(f"attempts:{job.id}", 0, -1) == ["t00000:c:1"]
    assert redis_client.lrange(f"handled:{job.id}", 0, -1) == ["t00000"]
    assert JobStore(redis_client).get(job.id).state == JobState.succeeded
    q = TaskQueue(redis_client, "test")
    assert q.pending() == 0 and redis_client.xlen(q.stream) == 0


def test_second_sigterm_gives_the_task_back_at_once(redis_server, redis_client):
    job = new_job(redis_client, 1, payload={"sleep": 600})
    lease_ms = 600_000
    victim = consumer(redis_server.url, "victim", lease_ms=lease_ms)
    try:
        wait_until(lambda: redis_client.llen(f"attempts:{job.id}") == 1)
        for _ in range(100):  # signals sent back to back may merge: send until it exits
            victim.send_signal(signal.SIGTERM)
            try:
                victim.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                continue
        assert victim.wait(60) == 0
    finally:
        stop_all([victim])
    q = TaskQueue(redis_client, "test")
    [entry] = redis_client.xpending_range(q.stream, q.group, min="-", max="+", count=10)
    assert entry["time_since_delivered"] > lease_ms  # released, not waiting out its lease
    assert redis_client.llen(f"handled:{job.id}") == 0
    survivor = consumer(redis_server.url, "survivor", lease_ms=lease_ms)
    try:
        wait_until(lambda: JobStore(redis_client).get(job.id).state == JobState.succeeded)
    finally:
        stop_all([survivor])
    assert redis_client.lrange(f"attempts:{job.id}", 0, -1) == ["t00000:victim:1", "t00000:survivor:2"]
    assert redis_client.lrange(f"handled:{job.id}", 0, -1) == ["t00000"]
    assert q.pending() == 0


def test_tasks_claimed_ahead_are_given_back_on_shutdown_without_using_a_delivery(redis_client):
    jobs = JobStore(redis_client)
    new_job(redis_client, 200)
    q = TaskQueue(redis_client, "test")
    handled = []

    def handle(task, ctx):
        handled.append((task.key, task.deliveries))
        if len(handled) == 49:  # batches of 1, 2, 4, 8, 16, 16, 16: 14 of the last are not started
            worker.stopping.set()

    worker = Worker(q, jobs, handle, consumer="w1", block_ms=100, batch_s=60, max_batch=16)
    worker.run()
    assert len(handled) == 49
    given_back = redis_client.xpending_range(q.stream, q.group, min="-", max="+", count=100)
    assert len(given_back) == 14
    assert all(e["times_delivered"] == 0 and e["time_since_delivered"] > q.lease_ms for e in given_back)
    Worker(q, jobs, handle, consumer="w2", block_ms=100).run(idle_exit_s=0.5)
    assert sorted(handled) == [(f"t{i:05d}", 1) for i in range(200)]
    assert q.pending() == 0 and redis_client.xlen(q.stream) == 0


def test_a_slow_task_in_a_batch_gives_back_the_tasks_claimed_behind_it(redis_client):
    jobs = JobStore(redis_client)
    new_job(redis_client, 100)
    q = TaskQueue(redis_client, "test")
    handled = []
    given_back_while_running = []

    def others_given_back(task) -> bool:
        """Every other task this consumer holds is idle past the lease (given back, reclaimable)."""
        rows = redis_client.xpending_range(q.stream, q.group, min="-", max="+", count=100, consumername="w")
        return all(r["time_since_delivered"] > q.lease_ms for r in rows if r["message_id"] != task.id)

    def handle(task, ctx):
        handled.append((task.key, task.deliveries))
        if task.key == "t00040":  # 10th of the batch of 16 that starts at t00031: a slow one
            deadline = time.monotonic() + 20
            while not others_given_back(task) and time.monotonic() < deadline:
                time.sleep(0.05)
            given_back_while_running.append(others_given_back(task))

    worker = Worker(q, jobs, handle, consumer="w", block_ms=100, batch_s=60, max_batch=16)
    worker.hold_s = 0.1
    redis_client.config_resetstat()
    worker.run(idle_exit_s=0.5)
    # the tasks behind the slow one were free for other consumers while it ran, not after
    assert given_back_while_running == [True]
    assert redis_client.info("commandstats")["cmdstat_xclaim"]["calls"] == 6  # t00041..t00046 given back
    assert sorted(handled) == [(f"t{i:05d}", 1) for i in range(100)]  # then taken again, with no delivery used
    assert q.pending() == 0 and redis_client.xlen(q.stream) == 0


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


def test_a_task_released_on_every_shutdown_is_never_dead_lettered(redis_client):
    """Graceful stops (rolling deploys, scale-in) give the task back with its delivery: however many
    there are, the task is not counted as failing."""
    job = new_job(redis_client, 1)
    q = TaskQueue(redis_client, "test", max_deliveries=3)
    jobs = JobStore(redis_client)
    seen = []

    def handle(task, ctx):
        seen.append(task.deliveries)
        if len(seen) <= 5:  # five shutdowns in a row, each checkpointing and releasing the task
            raise TaskReleased(task.job_id)
        jobs.complete_task(task.job_id, task.key)

    for _ in range(6):
        Worker(q, jobs, handle, consumer="w", block_ms=100).run(max_tasks=1, idle_exit_s=2)
    assert seen == [1] * 6
    assert not q.dead_letters() and q.pending() == 0
    assert jobs.get(job.id).state != JobState.failed and jobs.is_task_done(job.id, "t00000")
