"""The task-consuming loop every queue worker runs: lease, heartbeat, ack, retry, cancel, SIGTERM.

A service supplies a handler ``handle(task, ctx) -> dict | None``. The loop:

* claims a task (reclaiming those of dead consumers first);
* skips and acks tasks of cancelled jobs, and tasks already counted as done (redelivery after
  a crash between counting and acking);
* runs the handler while a heartbeat thread keeps the lease;
* on success acks; on an exception records the error, retries or dead-letters, and when a task
  is dead-lettered fails its job with the error;
* on SIGTERM/SIGINT finishes the task in hand, then exits (a second signal releases it at once).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram

from .jobs import JobNotFound, JobState, JobStore
from .queue import Task, TaskQueue, default_consumer_name

log = logging.getLogger(__name__)

TASKS = Counter("dfp_worker_tasks_total", "Tasks finished by outcome", ["kind", "outcome"])
TASK_SECONDS = Histogram("dfp_worker_task_seconds", "Task wall time", ["kind"],
                         buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))


class TaskCancelled(Exception):
    """Raised by a handler that noticed its job was cancelled mid-task."""


class TaskReleased(Exception):
    """Raised by a handler that gave its task back (e.g. on shutdown) without failing it."""


@dataclass
class TaskContext:
    queue: TaskQueue
    jobs: JobStore
    task: Task
    stopping: threading.Event
    extras: dict = field(default_factory=dict)

    def cancelled(self) -> bool:
        return self.jobs.is_cancelled(self.task.job_id)

    def check(self) -> None:
        """Raise if the job was cancelled (call between units of work)."""
        if self.cancelled():
            raise TaskCancelled(self.task.job_id)


Handler = Callable[[Task, TaskContext], "dict | None"]


class Worker:
    def __init__(self, queue: TaskQueue, jobs: JobStore, handler: Handler, *, consumer: str | None = None,
                 heartbeat_s: float | None = None, block_ms: int = 1000):
        self.queue = queue
        self.jobs = jobs
        self.handler = handler
        self.consumer = consumer or default_consumer_name()
        self.heartbeat_s = heartbeat_s or max(0.5, queue.lease_ms / 1000 / 3)
        self.block_ms = block_ms
        self.stopping = threading.Event()
        self.abort = threading.Event()
        self.tasks_done = 0
        self._started_jobs: set[str] = set()
        self._job_checked: dict[str, float] = {}
        self._current: Task | None = None
        self._beat_lock = threading.Lock()
        self._beat_thread: threading.Thread | None = None

    def install_signal_handlers(self) -> None:
        def on_signal(signum, _frame):
            if self.stopping.is_set():
                self.abort.set()
            self.stopping.set()
            log.info("shutdown requested; finishing the task in hand", extra={"signal": signum})

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run(self, max_tasks: int | None = None, idle_exit_s: float | None = None) -> int:
        """Consume until stopped (or ``max_tasks`` done, or idle for ``idle_exit_s``). Returns tasks handled."""
        self.queue.ensure_group()
        idle_since = time.monotonic()
        while not self.stopping.is_set():
            if max_tasks is not None and self.tasks_done >= max_tasks:
                break
            tasks = self.queue.claim(self.consumer, block_ms=self.block_ms)
            if not tasks:
                if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
                continue
            for task in tasks:
                self.process(task)
            idle_since = time.monotonic()
        return self.tasks_done

    def _job_live(self, job_id: str) -> bool | None:
        """True if the job takes tasks, False if it was cancelled or failed, None if it does not exist.
        The cancel flag is checked every time; the full record at most every 200 ms per job."""
        now = time.monotonic()
        if now - self._job_checked.get(job_id, -1.0) < 0.2:
            return not self.jobs.is_cancelled(job_id)
        try:
            state = self.jobs.get(job_id).state
        except JobNotFound:
            return None
        if state in (JobState.cancelled, JobState.failed) or self.jobs.is_cancelled(job_id):
            self._job_checked.pop(job_id, None)
            return False
        self._job_checked[job_id] = now
        if job_id not in self._started_jobs:
            self.jobs.start(job_id)
            self._started_jobs.add(job_id)
        return True

    def process(self, task: Task) -> None:
        kind = self.queue.kind
        live = self._job_live(task.job_id)
        if live is None:
            self.queue.dead_letter(task, f"job {task.job_id} does not exist")
            return
        if not live:
            self.queue.ack(task)
            TASKS.labels(kind, "skipped_cancelled").inc()
            return
        if self.jobs.is_task_done(task.job_id, task.key):
            self.queue.ack(task)
            TASKS.labels(kind, "skipped_done").inc()
            return
        ctx = TaskContext(self.queue, self.jobs, task, self.stopping)
        self._ensure_heartbeat()
        with self._beat_lock:
            self._current = task
        start = time.monotonic()
        try:
            self.handler(task, ctx)
        except TaskCancelled:
            self.queue.ack(task)
            TASKS.labels(kind, "cancelled").inc()
        except TaskReleased:
            self.queue.release(task)
            TASKS.labels(kind, "released").inc()
        except Exception as exc:  # noqa: BLE001 - any handler error is recorded against the task
            error = f"{type(exc).__name__}: {exc}"
            log.error("task failed", extra={"kind": kind, "task": task.id, "job_id": task.job_id, "key": task.key,
                                            "deliveries": task.deliveries, "error": error,
                                            "trace": traceback.format_exc(limit=5)})
            dead = self.queue.fail(task, error)
            TASKS.labels(kind, "dead" if dead else "failed").inc()
            if dead:
                self._fail_job(task, f"task {task.key!r} failed {task.deliveries} times; last error: {error}")
        else:
            self.queue.ack(task)
            TASKS.labels(kind, "ok").inc()
        finally:
            with self._beat_lock:
                self._current = None
            TASK_SECONDS.labels(kind).observe(time.monotonic() - start)
            self.tasks_done += 1

    def _ensure_heartbeat(self) -> None:
        if self._beat_thread is None or not self._beat_thread.is_alive():
            self._beat_thread = threading.Thread(target=self._heartbeat, name="task-heartbeat", daemon=True)
            self._beat_thread.start()

    def _heartbeat(self) -> None:
        """Keep the lease of the task in hand: one thread for the worker's life."""
        beaten: dict[str, float] = {}
        while not self.abort.wait(min(0.5, self.heartbeat_s / 2)):
            with self._beat_lock:
                task = self._current
            if task is None:
                continue
            since = beaten.setdefault(task.id, time.monotonic())
            if time.monotonic() - since < self.heartbeat_s:
                continue
            beaten = {task.id: time.monotonic()}
            try:
                if not self.queue.heartbeat(task):
                    log.warning("lost the lease of a task", extra={"task": task.id, "job_id": task.job_id})
            except Exception as exc:  # noqa: BLE001 - Redis may be restarting; the next beat retries
                log.warning("heartbeat failed", extra={"task": task.id, "error": str(exc)})

    def _fail_job(self, task: Task, error: str) -> None:
        try:
            self.jobs.transition(task.job_id, JobState.failed, error=error)
        except Exception as exc:  # noqa: BLE001 - already terminal
            log.info("job not failed", extra={"job_id": task.job_id, "reason": str(exc)})
