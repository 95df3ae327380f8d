"""Task throughput of the Redis Streams queue: enqueue -> the worker loop -> ack.

Project: the shared ``Worker`` loop every queue service runs (claim, reclaim, job and cancel
checks, exactly-once skip, heartbeat, ack) in 4 consumer processes with a no-op handler, timed
from the first enqueue until every task is acked. Limit: one client doing only the irreducible
Redis work on the same number of tasks — pipelined XADD, then XREADGROUP and pipelined XACK/XDEL
in batches of ``--batch``. A private redis-server runs for the measurement; each figure is the
best of ``--repeats`` runs. Unit: tasks/s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import time

from _common import report
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.redis_conn import connect
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.worker import Worker

from tests.support.servers import RedisServer

KIND = "bench"


def consume(url: str, name: str) -> None:
    r = connect(url)
    worker = Worker(TaskQueue(r, KIND), JobStore(r), lambda task, ctx: None, consumer=name, block_ms=100)
    worker.install_signal_handlers()
    worker.run()


def project(url: str, n: int, consumers: int) -> float:
    r = connect(url)
    q = TaskQueue(r, KIND)
    q.ensure_group()
    job, _ = JobStore(r).create(KIND, {}, totals={"tasks": n})
    procs = [mp.Process(target=consume, args=(url, f"c{i}")) for i in range(consumers)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # consumers connected and blocking: time the queue, not process start-up
    t0 = time.perf_counter()
    for start in range(0, n, 1000):
        q.enqueue_many(job.id, [(f"t{i}", {"i": i}) for i in range(start, min(n, start + 1000))])
    while r.xlen(q.stream):  # a worker deletes a task's entry when it acks it
        time.sleep(0.002)
    elapsed = time.perf_counter() - t0
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)
    for p in procs:
        p.join()
    if q.pending() or r.xlen(q.dead_stream):
        raise RuntimeError(f"{q.pending()} tasks pending and {r.xlen(q.dead_stream)} dead-lettered after the run")
    return n / elapsed


def limit(url: str, n: int, batch: int) -> float:
    r = connect(url)
    r.delete("raw")
    r.xgroup_create("raw", "g", id="0", mkstream=True)
    t0 = time.perf_counter()
    for start in range(0, n, 1000):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + 1000)):
            pipe.xadd("raw", {"job_id": "job", "key": f"t{i}", "payload": json.dumps({"i": i})})
        pipe.execute()
    got = 0
    while got < n:
        resp = r.xreadgroup("g", "c", {"raw": ">"}, count=batch)
        ids = [i for _, entries in resp for i, _ in entries]
        pipe = r.pipeline(transaction=False)
        pipe.xack("raw", "g", *ids)
        pipe.xdel("raw", *ids)
        pipe.execute()
        got += len(ids)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tasks", type=int, default=50_000)
    ap.add_argument("--consumers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=100, help="XREADGROUP count of the limit")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    server = RedisServer().start()
    try:
        lim = max(limit(server.url, args.tasks, args.batch) for _ in range(args.repeats))
        proj = max(project(server.url, args.tasks, args.consumers) for _ in range(args.repeats))
    finally:
        server.stop()
    report("queue", "tasks/s", proj, limit=lim, tasks=args.tasks, consumers=args.consumers, batch=args.batch)


if __name__ == "__main__":
    main()
