"""A queue consumer process for tests: runs the shared Worker loop with a small real handler.

Each handled task appends its key to ``handled:<job>`` and counts it with ``complete_task``.
A task whose payload has ``sleep`` sleeps that long first on its first delivery (so it can be
killed mid-task), one with ``hang`` on every delivery; one with ``fail`` always raises. The process
exits 0 after SIGTERM (it finishes the task in hand) or a second one (it gives the task back).
"""

from __future__ import annotations

import argparse
import time

from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.redis_conn import connect
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.worker import Worker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--kind", default="test")
    ap.add_argument("--lease-ms", type=int, default=60_000)
    ap.add_argument("--max-deliveries", type=int, default=3)
    ap.add_argument("--consumer", default=None)
    ap.add_argument("--idle-exit-s", type=float, default=None)
    args = ap.parse_args()
    r = connect(args.redis_url)
    queue = TaskQueue(r, args.kind, lease_ms=args.lease_ms, max_deliveries=args.max_deliveries)
    jobs = JobStore(r)

    def handle(task, ctx):
        if task.payload.get("fail"):
            raise RuntimeError(f"task {task.key} always fails")
        r.rpush(f"attempts:{task.job_id}", f"{task.key}:{args.consumer}:{task.deliveries}")
        if task.payload.get("sleep") and task.deliveries == 1:  # only the first attempt is slow
            time.sleep(float(task.payload["sleep"]))
        if task.payload.get("hang"):
            time.sleep(float(task.payload["hang"]))
        r.rpush(f"handled:{task.job_id}", task.key)
        jobs.complete_task(task.job_id, task.key, items=1)
        if jobs.all_tasks_done(task.job_id):
            finish_job(r, task.job_id, "succeeded")

    worker = Worker(queue, jobs, handle, consumer=args.consumer, block_ms=200)
    worker.install_signal_handlers()
    worker.run(idle_exit_s=args.idle_exit_s)


if __name__ == "__main__":
    main()
