"""Task throughput of the Redis Streams queue: enqueue -> consume -> ack.

Project: ``TaskQueue`` with 4 consumer processes, each claiming batches and acking them in one
round trip (the path a worker pool takes). Limit: one client doing only the irreducible Redis
work on the same number of tasks — pipelined XADD, then XREADGROUP and pipelined XACK in the same
batch size. A private redis-server runs for the measurement. Unit: tasks/s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

from _common import report
from dfp_shared.queue import TaskQueue
from dfp_shared.redis_conn import connect

from tests.support.servers import RedisServer


def consume(url: str, kind: str, name: str, batch: int, total: int, done) -> None:
    q = TaskQueue(connect(url), kind)
    while done.value < total:
        tasks = q.claim(name, block_ms=100, count=batch)
        if tasks:
            q.ack_many(tasks)
            with done.get_lock():
                done.value += len(tasks)


def project(url: str, n: int, consumers: int, batch: int) -> float:
    q = TaskQueue(connect(url), "bench")
    q.ensure_group()
    done = mp.Value("i", 0)
    procs = [mp.Process(target=consume, args=(url, "bench", f"c{i}", batch, n, done)) for i in range(consumers)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # consumers connected and blocking: time the queue, not process start-up
    t0 = time.perf_counter()
    for start in range(0, n, 1000):
        q.enqueue_many("job", [(f"t{i}", {"i": i}) for i in range(start, min(n, start + 1000))])
    for p in procs:
        p.join()
    return n / (time.perf_counter() - t0)


def limit(url: str, n: int, batch: int) -> float:
    r = connect(url)
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
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args()
    server = RedisServer().start()
    try:
        lim = limit(server.url, args.tasks, args.batch)
        proj = project(server.url, args.tasks, args.consumers, args.batch)
    finally:
        server.stop()
    report("queue", "tasks/s", proj, limit=lim, tasks=args.tasks, consumers=args.consumers, batch=args.batch)


if __name__ == "__main__":
    main()
