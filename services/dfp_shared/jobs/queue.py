"""Task queue on Redis Streams consumer groups.

One stream per task kind (``dfp:tasks:<kind>``), one consumer group of workers. A task is
delivered to one consumer with a lease; the consumer heartbeats while it works and acks when it
is done. Tasks whose consumer died (idle past the lease) are reclaimed with XAUTOCLAIM by the
next consumer that asks. A task delivered ``max_deliveries`` times without an ack moves to the
dead-letter stream ``dfp:tasks:<kind>:dead`` with its last error; a claim that dead-letters a task
reports it to the caller's ``on_dead`` callback, so the consumer can fail the job that owns it.

A consumer that gives a task back (a failed attempt, a shutdown) marks it released; a task reclaimed without
that mark was held by a consumer that died (or lost its lease) while running it. Such a task gets one more
try: the second death dead-letters it with :data:`WORKER_DIED`, so a task that kills its worker (a file
that exhausts memory) is not handed to one worker after another.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from redis.exceptions import ResponseError

from dfp_shared.printable import printable

log = logging.getLogger(__name__)

GROUP = "workers"
LEASE_EXPIRED = "consumer died or lease expired"
"""The error of a task dead-lettered with no failure on record: every consumer of it died."""
WORKER_DIED = "its worker died while running it, twice"
"""The error of a task dead-lettered at its second death (see the module)."""
MAX_DEATHS = 2


def stream_name(kind: str) -> str:
    return f"dfp:tasks:{kind}"


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class Task:
    id: str
    """Stream entry id."""
    job_id: str
    key: str
    """Deterministic task key within its job (e.g. the input file)."""
    payload: dict
    deliveries: int = 1
    consumer: str = ""
    fields: dict = field(default_factory=dict, repr=False)


class TaskQueue:
    """Enqueue, consume with a lease, heartbeat, ack, reclaim and dead-letter tasks of one kind."""

    def __init__(self, client: redis.Redis, kind: str, *, lease_ms: int = 60_000, max_deliveries: int = 3,
                 group: str = GROUP):
        self.r = client
        self.kind = kind
        self.stream = stream_name(kind)
        self.dead_stream = self.stream + ":dead"
        self.errors_key = self.stream + ":errors"
        self.released_key = self.stream + ":released"  # entry id -> 1: given back cleanly since its last claim
        self.deaths_key = self.stream + ":deaths"  # entry id -> times its consumer died holding it
        self.group = group
        self.lease_ms = lease_ms
        self.max_deliveries = max_deliveries
        self._group_ready = False

    # setup

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _call(self, fn, *args, **kwargs):
        """Run a group command, recreating the group if Redis lost it (restart without persistence)."""
        if not self._group_ready:
            self.ensure_group()
        try:
            return fn(*args, **kwargs)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()
            return fn(*args, **kwargs)

    # producer side

    def enqueue(self, job_id: str, key: str, payload: dict) -> str:
        return self.enqueue_many(job_id, [(key, payload)])[0]

    def enqueue_many(self, job_id: str, items: list[tuple[str, dict]]) -> list[str]:
        """Add tasks in one pipelined round trip; returns their stream ids."""
        self.ensure_group()
        pipe = self.r.pipeline(transaction=False)
        for key, payload in items:
            pipe.xadd(self.stream, {"job_id": job_id, "key": key, "payload": json.dumps(payload)})
        return pipe.execute()

    # consumer side

    def _to_task(self, entry_id: str, fields: dict, consumer: str, deliveries: int) -> Task:
        return Task(id=entry_id, job_id=fields.get("job_id", ""), key=fields.get("key", ""),
                    payload=json.loads(fields.get("payload") or "{}"), deliveries=deliveries,
                    consumer=consumer, fields=fields)

    def claim(self, consumer: str, block_ms: int = 1000, count: int = 1,
              on_dead: Callable[[Task, str], None] | None = None) -> list[Task]:
        """Next tasks for ``consumer``: stale tasks of dead consumers first, then new ones.

        Tasks past their delivery limit are moved to the dead-letter stream on the way, each once
        ``on_dead(task, last_error)`` has returned (``task.deliveries`` is then the attempts made).
        """
        tasks = self._reclaim(consumer, count, on_dead)
        if tasks:
            return tasks
        resp = self._call(self.r.xreadgroup, self.group, consumer, {self.stream: ">"}, count=count, block=block_ms)
        out = []
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                if fields:
                    out.append(self._to_task(entry_id, fields, consumer, 1))
        return out

    def _reclaim(self, consumer: str, count: int, on_dead: Callable[[Task, str], None] | None) -> list[Task]:
        resp = self._call(self.r.xautoclaim, self.stream, self.group, consumer, min_idle_time=self.lease_ms,
                          start_id="0-0", count=count)
        claimed = resp[1] if resp else []
        deleted = resp[2] if resp and len(resp) > 2 else []
        for entry_id in deleted:  # entries trimmed from the stream while pending
            self.r.xack(self.stream, self.group, entry_id)
        out = []
        for entry_id, fields in claimed:
            if not fields:
                self.r.xack(self.stream, self.group, entry_id)
                continue
            deliveries = self._deliveries(entry_id)
            task = self._to_task(entry_id, fields, consumer, deliveries)
            if self._died_holding(entry_id):
                task.deliveries -= 1
                if on_dead is not None:
                    on_dead(task, WORKER_DIED)
                self.dead_letter(task, WORKER_DIED)
                continue
            if deliveries > self.max_deliveries:
                task.deliveries -= 1  # this delivery only moves it: count the attempts made
                last = self.r.hget(self.errors_key, entry_id) or LEASE_EXPIRED
                if on_dead is not None:
                    on_dead(task, last)  # first: if it raises, a later claim reports the task again
                self.dead_letter(task, last)
                continue
            log.warning("reclaimed task of a dead or slow consumer",
                        extra={"stream": self.stream, "task": entry_id, "job_id": task.job_id, "deliveries": deliveries})
            out.append(task)
        return out

    def _died_holding(self, entry_id: str) -> bool:
        """Whether this reclaim follows the second death of a consumer holding ``entry_id`` (counting this
        one, when the entry was not given back since it was last claimed)."""
        if self.r.hdel(self.released_key, entry_id):
            return False
        deaths = self.r.hincrby(self.deaths_key, entry_id, 1)
        log.warning("a consumer died holding a task", extra={"stream": self.stream, "task": entry_id,
                                                             "deaths": deaths})
        return deaths >= MAX_DEATHS

    def _deliveries(self, entry_id: str) -> int:
        rows = self.r.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        return int(rows[0]["times_delivered"]) if rows else 1

    def heartbeat(self, task: Task) -> bool:
        """Reset the task's idle time so it is not reclaimed; False if another consumer took it."""
        mine = self._call(self.r.xpending_range, self.stream, self.group, min=task.id, max=task.id, count=1,
                          consumername=task.consumer)
        if not mine:
            return False
        got = self._call(self.r.xclaim, self.stream, self.group, task.consumer, 0, [task.id], justid=True)
        return bool(got)

    def _forget(self, pipe, *ids: str) -> None:
        """Queue on ``pipe`` the commands that end tasks: acked, off the stream, their bookkeeping gone."""
        pipe.xack(self.stream, self.group, *ids)
        pipe.xdel(self.stream, *ids)
        pipe.hdel(self.errors_key, *ids)
        pipe.hdel(self.released_key, *ids)
        pipe.hdel(self.deaths_key, *ids)

    def ack(self, task: Task) -> None:
        pipe = self.r.pipeline(transaction=True)
        self._forget(pipe, task.id)
        pipe.execute()

    def ack_many(self, tasks: list[Task], pipe: redis.client.Pipeline | None = None) -> None:
        """Ack a batch of finished tasks in one round trip (or queue the acks on ``pipe`` to send
        with other commands)."""
        if not tasks:
            return
        ids = [t.id for t in tasks]
        own = pipe is None
        pipe = self.r.pipeline(transaction=False) if own else pipe
        self._forget(pipe, *ids)
        if own:
            pipe.execute()

    def release(self, task: Task, attempted: bool = True) -> None:
        """Give a task back now (e.g. on shutdown): it becomes reclaimable by any consumer at once.
        A task never ``attempted`` (claimed ahead, then given back) gets its delivery back too."""
        retry = None if attempted else max(0, task.deliveries - 1)
        self.r.hset(self.released_key, task.id, 1)
        self._call(self.r.xclaim, self.stream, self.group, task.consumer, 0, [task.id],
                   idle=self.lease_ms + 1, retrycount=retry, justid=True)

    def fail(self, task: Task, error: str) -> bool:
        """Record a failed attempt. Dead-letters the task if it used its deliveries, else releases it
        for a retry. Returns True if it was dead-lettered."""
        if task.deliveries >= self.max_deliveries:
            self.dead_letter(task, error)
            return True
        self.r.hset(self.errors_key, task.id, printable(error[:4000]))
        self.release(task)
        return False

    def dead_letter(self, task: Task, error: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.dead_stream, {**task.fields, "error": printable(error[:4000]), "deliveries": task.deliveries,
                                     "original_id": task.id, "dead_at": f"{time.time():.3f}"})
        self._forget(pipe, task.id)
        pipe.execute()
        log.error("task dead-lettered", extra={"stream": self.stream, "task": task.id, "job_id": task.job_id,
                                               "key": task.key, "deliveries": task.deliveries, "error": error[:500]})

    # inspection

    def dead_letters(self, count: int = 100) -> list[dict]:
        return [dict(fields, id=i) for i, fields in self.r.xrange(self.dead_stream, count=count)]

    def lag(self) -> int:
        """Entries not yet delivered to the group (what KEDA's redis-streams scaler reads)."""
        try:
            for g in self.r.xinfo_groups(self.stream):
                if g["name"] == self.group:
                    return int(g.get("lag") or 0)
        except ResponseError:
            return 0
        return 0

    def pending(self) -> int:
        try:
            return int(self.r.xpending(self.stream, self.group)["pending"])
        except ResponseError:
            return 0
