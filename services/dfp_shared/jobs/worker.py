"""The task-consuming loop every queue worker runs: lease, heartbeat, ack, retry, cancel, SIGTERM.

A service supplies a handler ``handle(task, ctx) -> dict | None``. The loop:

* claims tasks (reclaiming those of dead consumers first): one at a time while tasks are slow,
  several at once while each takes a small part of ``batch_s``, so fast tasks share round trips;
* skips and acks tasks of cancelled jobs, and tasks already counted as done (redelivery after
  a crash between counting and acking); the cancel and done flags it acts on are never older
  than ``batch_s``, and a handler's ``TaskCancelled`` applies to the job's next task at once;
* runs the handler while a heartbeat thread keeps the lease of every task in hand (a
  :class:`JobHandler` first admits the task: see there);
* on success acks (a batch's acks go out together: every ``batch_s``, at its end, or on the next
  heartbeat tick if a long task follows);
  on an exception records the error, retries or dead-letters;
* fails the job of a task that is dead-lettered, whether its handler kept raising or its
  consumers kept dying (a claim reports those);
* on SIGTERM/SIGINT finishes the task in hand, gives back the tasks claimed ahead, then exits;
  a second signal interrupts the handler (``WorkerAborted``, like ``KeyboardInterrupt``) and
  gives the task in hand back at once, so another consumer takes it without waiting for its lease.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ValidationError

from dfp_shared.jobs.failures import CannotSucceed
from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.queue import LEASE_EXPIRED, WORKER_DIED, Task, TaskQueue, default_consumer_name
from dfp_shared.jobs.store import JobNotFound, JobRecord, JobState, JobStore
from dfp_shared.jobs.types import JobType, task_job_type
from dfp_shared.signals import StopSignals
from dfp_shared.storage.ownership import OutputClaims
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import AccessRefused

log = logging.getLogger(__name__)

TASKS = Counter("dfp_worker_tasks_total", "Tasks finished by outcome", ["kind", "outcome"])
TASK_SECONDS = Histogram("dfp_worker_task_seconds", "Task wall time", ["kind"],
                         buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))


class TaskCancelled(Exception):
    """Raised by a handler that noticed its job was cancelled mid-task."""


class TaskReleased(Exception):
    """Raised by a handler that gave its task back (e.g. on shutdown) without failing it."""


class WorkerAborted(BaseException):
    """Raised in the main thread by a second SIGTERM/SIGINT: stop now, give the tasks in hand back."""


@dataclass
class TaskContext:
    queue: TaskQueue
    jobs: JobStore
    task: Task
    stopping: threading.Event
    extras: dict = field(default_factory=dict)
    abort: threading.Event | None = None
    # set by JobHandler before its handle(): the job, the type the task runs as, and the job's spec
    job: JobRecord | None = None
    job_type: JobType | None = None
    spec: BaseModel | None = None

    def cancelled(self) -> bool:
        return self.jobs.is_cancelled(self.task.job_id)

    def stop_check(self, cancel_every_s: float = 0.5) -> Callable[[], bool]:
        """A ``should_stop()`` cheap enough to ask every step of a long computation: true once the worker
        is stopping (a signal; read every call) or the job is cancelled (read from Redis at most every
        ``cancel_every_s``)."""
        state = {"at": float("-inf"), "cancelled": False}

        def should_stop() -> bool:
            if self.stopping.is_set() or state["cancelled"]:
                return True
            now = time.monotonic()
            if now - state["at"] >= cancel_every_s:
                state["at"], state["cancelled"] = now, self.cancelled()
            return state["cancelled"]

        return should_stop

    def check(self) -> None:
        """Raise if the worker was aborted (a second signal; in any thread) or the job was cancelled
        (call between units of work)."""
        if self.abort is not None and self.abort.is_set():
            raise WorkerAborted()
        if self.cancelled():
            raise TaskCancelled(self.task.job_id)


Handler = Callable[[Task, TaskContext], "dict | None"]


class JobHandler:
    """The handler of a service's job tasks. Before :meth:`handle` runs, each task is admitted:

    * the job's spec is validated with its type's model (:func:`~dfp_shared.jobs.types.task_job_type`);
      an invalid one fails the job at once (``invalid <type> spec: ...``), as a retry cannot help;
    * before any I/O (the task may come from anyone who can write to Redis) every storage URI of the
      spec is checked against ``roots``, and the task's own by :meth:`confine_task`;
    * the output prefix is claimed for the job's owner (:class:`~dfp_shared.storage.ownership.OutputClaims`).

    A refusal raises :class:`~dfp_shared.storage.store.AccessRefused`: the worker fails the job. ``handle``
    finds the job, its type and its spec on ``ctx``. A subclass sets ``roots`` and ``claims``.
    """

    roots: StorageRoots
    claims: OutputClaims
    # False: an invalid spec is an error like any other (retried, then dead-lettered)
    invalid_spec_fails_job = True

    def __call__(self, task: Task, ctx: TaskContext) -> None:
        if self.admit(task, ctx):
            self.handle(task, ctx)

    def admit(self, task: Task, ctx: TaskContext) -> bool:
        """Validate, confine and claim (see the class); False when the job was failed instead."""
        job = ctx.jobs.get(task.job_id)
        kind = task_job_type(ctx.queue.kind, job.type)
        try:
            spec = kind.spec.model_validate(job.spec)
        except ValidationError as exc:  # e.g. a removed field, written straight into Redis
            if not self.invalid_spec_fails_job:
                raise
            log.error("job cannot run", extra={"job_id": task.job_id, "error": str(exc)})
            finish_job(ctx.jobs.r, task.job_id, JobState.failed, error=f"invalid {kind.name} spec: {exc}")
            return False
        self.roots.check_spec(kind.name, spec)
        self.roots.check_reservations(kind.name, spec, job.owner)
        self.confine_task(task, spec, job.owner)
        self.claims.claim(spec.output, job.owner, task.job_id, parent_id=job.parent_id)
        ctx.job, ctx.job_type, ctx.spec = job, kind, spec
        return True

    def confine_task(self, task: Task, spec, owner: str | None) -> None:
        """Check the storage URIs the task itself carries (after the spec's, before the claim), against the roots
        and the prefixes reserved from ``owner`` (the job's principal)."""

    def handle(self, task: Task, ctx: TaskContext) -> None:
        raise NotImplementedError


class Worker:
    def __init__(self, queue: TaskQueue, jobs: JobStore, handler: Handler, *, consumer: str | None = None,
                 heartbeat_s: float | None = None, block_ms: int = 1000, batch_s: float = 0.02,
                 max_batch: int = 100):
        self.queue = queue
        self.jobs = jobs
        self.handler = handler
        self.consumer = consumer or default_consumer_name()
        self.heartbeat_s = heartbeat_s or max(0.5, queue.lease_ms / 1000 / 3)
        self.block_ms = block_ms
        self.batch_s = batch_s
        self.hold_s = max(0.1, 5 * batch_s)
        self.max_batch = max(1, max_batch)
        self.stopping = threading.Event()
        self.abort = threading.Event()
        self.tasks_done = 0
        self._started_jobs: set[str] = set()
        self._job_checked: dict[str, float] = {}
        self._task_s: float | None = None  # moving average of the loop's time per task
        self._last_batch = 1
        self._held: dict[str, Task] = {}  # claimed and not yet acked, released or dead-lettered
        self._unstarted: dict[str, Task] = {}  # held tasks of the batch whose handler has not started
        self._batch_started: float | None = None
        self._lost: set[str] = set()  # ids of held tasks another consumer took over
        self._acks: list[Task] = []
        self._cancel_flags: dict[str, bool] = {}  # job id -> cancelled, as of the last refresh
        self._done_flags: dict[str, bool] = {}  # task id -> counted as done, as of the last refresh
        self._beat_lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one ack round trip at a time (loop and heartbeat)
        self._beat_thread: threading.Thread | None = None
        self._outcomes: dict[str, Counter] = {}
        self._seconds = TASK_SECONDS.labels(queue.kind)

    def install_signal_handlers(self) -> None:
        def on_signal(_count, signum):
            if self.abort.is_set():
                return
            if self.stopping.is_set():
                self.abort.set()
                signals.ignore()  # as the check above would, also while the interpreter shuts down
                log.warning("second signal: giving the tasks in hand back", extra={"signal": signum})
                raise WorkerAborted()
            self.stopping.set()
            log.info("shutdown requested; finishing the task in hand", extra={"signal": signum})

        signals = StopSignals(on_signal).install()

    def run(self, max_tasks: int | None = None, idle_exit_s: float | None = None) -> int:
        """Consume until stopped (or ``max_tasks`` done, or idle for ``idle_exit_s``). Returns tasks handled."""
        self.queue.ensure_group()
        idle_since = time.monotonic()
        try:
            while not self.stopping.is_set():
                want = self._batch_size()
                if max_tasks is not None:
                    if self.tasks_done >= max_tasks:
                        break
                    want = min(want, max_tasks - self.tasks_done)
                tasks = self.queue.claim(self.consumer, block_ms=self.block_ms, count=want,
                                         on_dead=self._dead_lettered)
                if not tasks:
                    if idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                        break
                    continue
                self._work(tasks)
                idle_since = time.monotonic()
        except WorkerAborted:
            log.warning("worker aborted", extra={"consumer": self.consumer, "tasks": self.tasks_done})
        finally:
            try:
                self._flush()  # acks still owed (a heartbeat's flush may have failed)
            except Exception as exc:  # noqa: BLE001 - their tasks are redelivered and skipped as done
                log.warning("acks not sent", extra={"error": str(exc)})
            with self._beat_lock:  # whatever is left (the loop failed) waits out its lease
                self._held.clear()
                self._unstarted.clear()
        return self.tasks_done

    # batches

    def _batch_size(self) -> int:
        """One task while tasks are slow (or unknown); while fast, as many as fit in ``batch_s``,
        growing by at most twice the last batch (one fast task says little about the next ones)."""
        if not self._task_s:
            return 1
        return max(1, min(self.max_batch, 2 * self._last_batch, int(self.batch_s / self._task_s)))

    def _work(self, tasks: list[Task]) -> None:
        """Handle claimed tasks in order. Flags are refreshed (and acks sent) every ``batch_s``. Once
        the batch has run past ``hold_s`` (a task was slower than its estimate), the tasks not started
        yet are given back for other consumers: by the heartbeat thread while a slow handler runs, or
        here when the loop gets to them first."""
        start = refreshed = time.monotonic()
        with self._beat_lock:
            self._held.update((t.id, t) for t in tasks)
            self._unstarted = {t.id: t for t in tasks}
            self._batch_started = start
        i = 0
        try:
            for i, task in enumerate(tasks):
                now = time.monotonic()
                if self.stopping.is_set() or (i and now - start > self.hold_s):
                    self._give_back_unstarted()
                    break
                with self._beat_lock:
                    if self._unstarted.pop(task.id, None) is None:
                        break  # the heartbeat gave the rest of the batch back
                if i == 0 or now - refreshed > self.batch_s:
                    self._refresh(tasks[i:])
                    refreshed = now
                self.process(task)
            else:
                i = len(tasks)
            self._flush()
        except WorkerAborted:
            try:
                self._flush()
            except Exception as exc:  # noqa: BLE001 - their tasks are redelivered
                log.warning("acks not sent", extra={"error": str(exc)})
            self._give_back(tasks[i:i + 1], attempted=True)
            self._give_back_unstarted()
            raise
        finally:
            self._cancel_flags, self._done_flags = {}, {}
            with self._beat_lock:
                self._batch_started = None
        self._last_batch = len(tasks)
        per_task = (time.monotonic() - start) / max(1, i)
        self._task_s = per_task if self._task_s is None else 0.7 * self._task_s + 0.3 * per_task

    def _refresh(self, tasks: list[Task]) -> None:
        """One round trip: send the acks so far, read the cancel and done flags of ``tasks`` (the
        keys ``JobStore.is_cancelled`` and ``JobStore.is_task_done`` read)."""
        by_job: dict[str, list[Task]] = {}
        for t in tasks:
            by_job.setdefault(t.job_id, []).append(t)

        def queue_checks(pipe):
            for job_id, job_tasks in by_job.items():
                JobStore.queue_task_flags(pipe, job_id, [t.key for t in job_tasks])

        flags = iter(self._flush(queue_checks))
        self._cancel_flags, self._done_flags = {}, {}
        for job_id, job_tasks in by_job.items():
            self._cancel_flags[job_id] = bool(next(flags))
            self._done_flags.update((t.id, bool(f)) for t, f in zip(job_tasks, next(flags)))

    def _flush(self, more: Callable | None = None) -> list:
        """Send the acks of the tasks handled so far (the heartbeat thread calls this too), with the
        commands ``more(pipe)`` queues in the same round trip; returns the replies to those."""
        with self._flush_lock:
            with self._beat_lock:
                acks, self._acks = self._acks, []
            pipe = self.queue.r.pipeline(transaction=False)
            self.queue.ack_many(acks, pipe=pipe)
            skip = len(pipe)
            if more is not None:
                more(pipe)
            try:
                replies = pipe.execute() if len(pipe) else []
            except BaseException:
                with self._beat_lock:
                    self._acks[:0] = acks  # sent again by the next flush
                raise
            self._drop(acks)
            return replies[skip:]

    def _drop(self, tasks: list[Task]) -> None:
        with self._beat_lock:
            for t in tasks:
                self._held.pop(t.id, None)
                self._lost.discard(t.id)

    def _give_back_unstarted(self) -> None:
        """Give back the batch's tasks whose handler has not started (claimed ahead, unattempted)."""
        with self._beat_lock:
            unstarted, self._unstarted = list(self._unstarted.values()), {}
        self._give_back(unstarted, attempted=False)

    def _give_back(self, tasks: list[Task], *, attempted: bool) -> None:
        for t in tasks:
            if t.id in self._held and t.id not in self._lost:  # (a lost task is another consumer's now)
                try:
                    self.queue.release(t, attempted=attempted)
                except Exception as exc:  # noqa: BLE001 - its lease runs out instead
                    log.warning("could not give a task back", extra={"task": t.id, "error": str(exc)})
                self._drop([t])

    # one task

    def _cancelled(self, job_id: str) -> bool:
        flag = self._cancel_flags.get(job_id)
        return self.jobs.is_cancelled(job_id) if flag is None else flag

    def _job_live(self, job_id: str) -> bool | None:
        """True if the job takes tasks, False if it was cancelled or failed, None if it does not exist.
        The cancel flag is checked for every task (as of the batch's last refresh); the full record at
        most every 200 ms per job."""
        now = time.monotonic()
        if now - self._job_checked.get(job_id, -1.0) < 0.2:
            return not self._cancelled(job_id)
        try:
            state = self.jobs.get(job_id).state
        except JobNotFound:
            return None
        if state in (JobState.cancelled, JobState.failed) or self._cancelled(job_id):
            self._job_checked.pop(job_id, None)
            return False
        self._job_checked[job_id] = now
        if job_id not in self._started_jobs:
            self.jobs.start(job_id)
            self._started_jobs.add(job_id)
        return True

    def _count(self, outcome: str) -> None:
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = TASKS.labels(self.queue.kind, outcome)
        child.inc()

    def _ack(self, task: Task, outcome: str) -> None:
        with self._beat_lock:
            self._acks.append(task)
        self._count(outcome)

    def process(self, task: Task) -> None:
        if task.id in self._lost:
            log.warning("skipped a task another consumer took over", extra={"task": task.id, "job_id": task.job_id})
            self._drop([task])
            return
        live = self._job_live(task.job_id)
        if live is None:
            self.queue.dead_letter(task, f"job {task.job_id} does not exist")
            self._drop([task])
            return
        if not live:
            self._cancel_flags[task.job_id] = True
            self._ack(task, "skipped_cancelled")
            return
        done = self._done_flags.get(task.id)
        if done or (done is None and self.jobs.is_task_done(task.job_id, task.key)):
            self._ack(task, "skipped_done")
            return
        self._run_handler(task)

    def _run_handler(self, task: Task) -> None:
        self._ensure_heartbeat()
        start = time.monotonic()
        try:
            self.handler(task, TaskContext(self.queue, self.jobs, task, self.stopping, abort=self.abort))
        except TaskCancelled:
            self._cancel_flags[task.job_id] = True
            self._ack(task, "cancelled")
        except TaskReleased:  # a stop, not a failure: the delivery is given back with the task
            self._give_back([task], attempted=False)
            self._count("released")
        except (AccessRefused, CannotSucceed) as exc:  # storage the job may not touch, a refused model, ...
            log.error("task refused", extra={"kind": self.queue.kind, "task": task.id, "job_id": task.job_id,
                                             "key": task.key, "error": str(exc)})
            self._fail_job(task, f"refused: {exc}")  # a retry cannot succeed
            self._ack(task, "refused")
        except Exception as exc:  # noqa: BLE001 - any handler error is recorded against the task
            error = f"{type(exc).__name__}: {exc}"
            log.error("task failed", extra={"kind": self.queue.kind, "task": task.id, "job_id": task.job_id,
                                            "key": task.key, "deliveries": task.deliveries, "error": error,
                                            "trace": traceback.format_exc(limit=5)})
            dead = self.queue.fail(task, error)
            self._drop([task])
            self._count("dead" if dead else "failed")
            if dead:
                self._fail_job(task, f"task {task.key!r} failed {task.deliveries} times; last error: {error}")
        else:
            self._ack(task, "ok")
        finally:
            self._seconds.observe(time.monotonic() - start)
            self.tasks_done += 1

    def _dead_lettered(self, task: Task, error: str) -> None:
        """A claim dead-lettered ``task`` (its consumers kept dying): fail its job, unless the task
        was already counted as done."""
        self._count("dead")
        if self.jobs.is_task_done(task.job_id, task.key):
            return
        if error == WORKER_DIED:
            reason = (f"task {task.key!r}: its worker died (or lost its lease) while running it, twice; it is not "
                      f"handed to another worker")
        elif error == LEASE_EXPIRED:
            reason = f"task {task.key!r} was delivered {task.deliveries} times and its worker died each time"
        else:
            reason = f"task {task.key!r} was delivered {task.deliveries} times without finishing; last error: {error}"
        self._fail_job(task, reason + "; dead-lettered")

    # heartbeat

    def _ensure_heartbeat(self) -> None:
        if self._beat_thread is None or not self._beat_thread.is_alive():
            self._beat_thread = threading.Thread(target=self._heartbeat, name="task-heartbeat", daemon=True)
            self._beat_thread.start()

    def _heartbeat(self) -> None:
        """Keep the leases of the tasks in hand, and send acks a long task would hold up: one thread
        for the worker's life."""
        beaten: dict[str, float] = {}
        while not self.abort.wait(min(0.5, self.heartbeat_s / 2)):
            try:
                self._flush()
            except Exception as exc:  # noqa: BLE001 - the loop sends them at the end of the batch
                log.warning("ack failed", extra={"error": str(exc)})
            with self._beat_lock:
                slow = self._batch_started is not None and time.monotonic() - self._batch_started > self.hold_s
            if slow and self._unstarted:  # a slow handler: its batch's other tasks go to other consumers
                self._give_back_unstarted()
            with self._beat_lock:
                held = list(self._held.values())
            now = time.monotonic()
            beaten = {t.id: beaten.get(t.id, now) for t in held}
            for task in held:
                if now - beaten[task.id] < self.heartbeat_s:
                    continue
                beaten[task.id] = now
                with self._beat_lock:
                    if task.id not in self._held:  # acked or given back meanwhile: not renewed
                        continue
                try:
                    kept = self.queue.heartbeat(task)
                except Exception as exc:  # noqa: BLE001 - Redis may be restarting; the next beat retries
                    log.warning("heartbeat failed", extra={"task": task.id, "error": str(exc)})
                    continue
                with self._beat_lock:
                    lost = not kept and task.id in self._held  # (not just acked)
                    if lost:
                        self._lost.add(task.id)
                if lost:
                    log.warning("lost the lease of a task", extra={"task": task.id, "job_id": task.job_id})

    def _fail_job(self, task: Task, error: str) -> None:
        try:
            if finish_job(self.jobs.r, task.job_id, JobState.failed, error=error) is None:
                log.info("job not failed: already finished", extra={"job_id": task.job_id})
        except Exception as exc:  # noqa: BLE001 - the task is dead-lettered either way
            log.warning("job not failed", extra={"job_id": task.job_id, "reason": str(exc)})
