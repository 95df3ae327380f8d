"""Per-key limits beside the request rate: open event streams, and queued plus running jobs.

Both are counted in Redis, so every API replica shares them.

* **Event streams**: a key's open streams are one sorted set (``dfp:quota:streams:<name>``), a member per
  stream scored by when it lapses; a stream renews its member at every poll and removes it when it
  ends, and a member whose stream died without saying so lapses after :data:`STREAM_LEASE_S`. One
  Lua script drops lapsed members, counts and adds, atomically. Beside that, a process holds at most
  ``max_event_streams`` streams of all keys together (they have a Redis pool of that size of their own), and
  counts each key's streams in the process too, so a burst past the key's limit is a 429 before it asks any
  pool for a connection: a stream's whole admission (key, rate, job, slot) uses the streams' pool only.
* **Active jobs**: the jobs a key submitted through the API are a set (``dfp:quota:jobs:<name>``);
  counting it drops the ones that ended. Counting and creating run under a per-key lock, so
  concurrent submits cannot pass the limit together.

Every refusal is a :class:`QuotaExceeded` (a 429 with ``Retry-After`` and the key's own usage) and
is counted in ``dfp_api_refusals_total`` by reason.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import anyio
import redis
import redis.asyncio as aioredis
from dfp_shared.jobs.store import JobState, JobStore
from prometheus_client import Counter

REFUSALS = Counter("dfp_api_refusals_total", "Requests refused by a per-key or per-server limit", ["reason"])

STREAM_LEASE_S = 20.0
"""A stream's slot lapses this long after its last renewal (a stream renews it at every poll)."""
STREAMS_PREFIX = "dfp:quota:streams:"
JOBS_PREFIX = "dfp:quota:jobs:"
JOB_RETRY_AFTER_S = 30

_TAKE_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[1]) then return {0, n} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) * 1000) + 1000)
return {1, n + 1}
"""
_RENEW_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 1000) + 1000)
return 1
"""


class QuotaExceeded(Exception):
    """A limit refused the request: ``reason`` (the metric's label and the error code), a message,
    seconds to wait, and the key's usage as the body's ``usage``."""

    def __init__(self, reason: str, message: str, retry_after_s: int, usage: dict):
        super().__init__(message)
        self.reason, self.message, self.retry_after_s, self.usage = reason, message, retry_after_s, usage
        REFUSALS.labels(reason).inc()


@dataclass
class StreamSlot:
    """One open event stream's place in its key's count (in this process, and in Redis once taken) and in
    the process's."""

    owner: StreamSlots
    name: str
    member: str
    taken: bool = field(default=False)
    released: bool = field(default=False)

    async def renew(self) -> None:
        if self.owner.per_key and self.taken:
            await self.owner._renew(keys=[STREAMS_PREFIX + self.name], args=[self.member, STREAM_LEASE_S])

    def __del__(self):  # a stream that never started (its client left first) gives its place back too
        if not self.released:
            self.released = True
            self.owner._leave(self.name)

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.owner._leave(self.name)
        if self.owner.per_key and self.taken:
            # a stream ends by cancellation when its client leaves: shielded, or the removal is cancelled too
            with anyio.CancelScope(shield=True), anyio.move_on_after(3):
                try:
                    await self.owner.r.zrem(STREAMS_PREFIX + self.name, self.member)
                except Exception:  # noqa: BLE001 - the slot lapses by itself
                    pass


class StreamSlots:
    """Event stream places: per process and per key in this process first (no Redis: a burst is refused
    before it touches a connection pool), then per key across replicas in Redis (the streams' own pool)."""

    def __init__(self, client: aioredis.Redis, per_key: int, per_process: int):
        self.r = client
        self.per_key = per_key
        self.per_process = per_process
        self.open = 0
        self.local: dict[str, int] = {}  # key name -> streams open or opening in this process
        self._take = client.register_script(_TAKE_SLOT)
        self._renew = client.register_script(_RENEW_SLOT)

    def enter(self, name: str) -> StreamSlot:
        """A place in this process (429 when the process or the key holds its limit here); the caller
        then :meth:`take` s it in Redis, or releases it."""
        if self.open >= self.per_process:
            raise QuotaExceeded("server_event_streams", f"this server holds its limit of {self.per_process} event "
                                "streams (DFLASH_MAX_EVENT_STREAMS); retry later", 5,
                                {"server_event_streams": self.open, "limit": self.per_process})
        held = self.local.get(name, 0)
        if self.per_key and held >= self.per_key:
            raise self._key_full(held)
        self.open += 1
        self.local[name] = held + 1
        return StreamSlot(self, name, uuid.uuid4().hex)

    async def take(self, slot: StreamSlot) -> None:
        """Count ``slot`` in its key's streams across replicas (429 when the key holds its limit)."""
        if self.per_key:
            taken, count = await self._take(keys=[STREAMS_PREFIX + slot.name],
                                            args=[self.per_key, slot.member, STREAM_LEASE_S])
            if not int(taken):
                raise self._key_full(int(count))
        slot.taken = True

    async def acquire(self, name: str) -> StreamSlot:
        """:meth:`enter` and :meth:`take` (the place is given back when taking it is refused)."""
        slot = self.enter(name)
        try:
            await self.take(slot)
        except BaseException:
            await slot.release()
            raise
        return slot

    def _key_full(self, count: int) -> QuotaExceeded:
        return QuotaExceeded("event_streams", f"this API key holds its limit of {self.per_key} open event streams "
                             "(DFLASH_MAX_STREAMS_PER_KEY); close one first", int(STREAM_LEASE_S),
                             {"event_streams": count, "limit": self.per_key})

    def _leave(self, name: str) -> None:
        self.open -= 1
        left = self.local.get(name, 1) - 1
        if left > 0:
            self.local[name] = left
        else:
            self.local.pop(name, None)


ACTIVE = (JobState.queued.value, JobState.running.value)


def active_jobs(r: redis.Redis, name: str) -> int:
    """How many of the jobs ``name`` submitted are queued or running (ended ones leave its set)."""
    key = JOBS_PREFIX + name
    ids = sorted(r.smembers(key))
    if not ids:
        return 0
    pipe = r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(JobStore.keys(job_id).record, "state")
    states = pipe.execute()
    ended = [job_id for job_id, state in zip(ids, states) if state not in ACTIVE]
    if ended:
        r.srem(key, *ended)
    return len(ids) - len(ended)


def jobs_lock(r: redis.Redis, name: str):
    """The lock one key's submits count and create under (held at most a few seconds)."""
    return r.lock(f"{JOBS_PREFIX}{name}:lock", timeout=10, blocking_timeout=10, sleep=0.01)


def check_active_jobs(r: redis.Redis, name: str, limit: int) -> None:
    """Raise :class:`QuotaExceeded` when ``name`` already has ``limit`` queued or running jobs."""
    count = active_jobs(r, name)
    if count >= limit:
        raise QuotaExceeded("active_jobs", f"this API key has its limit of {limit} queued and running jobs "
                            "(DFLASH_MAX_ACTIVE_JOBS_PER_KEY); wait for one to end, or cancel one",
                            JOB_RETRY_AFTER_S, {"active_jobs": count, "limit": limit})


def count_job(r: redis.Redis, name: str, job_id: str) -> None:
    r.sadd(JOBS_PREFIX + name, job_id)
