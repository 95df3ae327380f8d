"""Job records in Redis: one state machine, counters, rate and ETA, events and cancel flags.

The API and every worker use this one implementation, and only it names the keys (see
:class:`JobKeys`): ``dfp:job:<id>`` (hash: record), ``dfp:job:<id>:counters`` / ``:totals`` (hashes
of numbers), ``dfp:job:<id>:done`` (set of finished task keys, for exactly-once counting),
``dfp:job:<id>:events`` (stream of state and progress events), ``dfp:job:<id>:cancel`` (flag),
``dfp:job:<id>:live`` (generation's live shard progress), ``dfp:job:<id>:metrics`` (sorted set of
training metric points by step, the last :data:`METRICS_MAXLEN`), ``dfp:jobs`` (sorted set by creation
time) and ``dfp:idem:<key>`` (idempotency keys).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from enum import Enum

import redis

from dfp_shared.printable import printable

EVENTS_MAXLEN = 2000
METRICS_MAXLEN = 5000
"""Metric points kept per job (the newest); one point per logged training step."""
METRICS_PAGE_MAX = 1000
JOBS_INDEX = "dfp:jobs"
IDEMPOTENCY_PREFIX = "dfp:idem:"


class JobState(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


ALLOWED = {
    JobState.queued: {JobState.running, JobState.failed, JobState.cancelled},
    JobState.running: {JobState.succeeded, JobState.failed, JobState.cancelled},
    JobState.succeeded: set(),
    JobState.failed: set(),
    JobState.cancelled: set(),
}


class JobNotFound(KeyError):
    pass


class IllegalTransition(ValueError):
    def __init__(self, job_id: str, current: str, wanted: str):
        super().__init__(f"job {job_id} is {current}; cannot become {wanted}")
        self.current, self.wanted = current, wanted


@dataclass
class JobRecord:
    id: str
    type: str
    state: JobState
    spec: dict
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    outputs: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)
    primary_unit: str = "tasks"
    parent_id: str | None = None
    stage: str | None = None
    owner: str | None = None
    """The principal (API key name) that submitted the job; pipeline stages inherit it."""

    def progress(self, now: float | None = None) -> dict:
        """Per-unit done/total/fraction, rates per second since start, and the ETA of the primary unit."""
        now = now or time.time()
        end = self.finished_at or now
        elapsed = max(1e-9, end - self.started_at) if self.started_at else 0.0
        units = {}
        for unit in sorted(set(self.counters) | set(self.totals)):
            done = self.counters.get(unit, 0)
            total = self.totals.get(unit)
            units[unit] = {
                "done": done,
                "total": total,
                "fraction": (min(1.0, done / total) if total else None),
                "rate_per_s": (done / elapsed if elapsed else None),
            }
        primary = units.get(self.primary_unit, {})
        eta = None
        rate = primary.get("rate_per_s")
        if primary.get("total") is not None and rate and not self.state.terminal:
            eta = max(0.0, (primary["total"] - primary["done"]) / rate)
        return {"units": units, "primary_unit": self.primary_unit, "fraction": primary.get("fraction"),
                "rate_per_s": rate, "eta_s": eta, "elapsed_s": elapsed}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["state"] = self.state.value
        d["progress"] = self.progress()
        return d


_TRANSITION = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {err='NOTFOUND'} end
local allowed = cjson.decode(ARGV[1])
if not allowed[state] then return {'ILLEGAL', state} end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
if ARGV[2] == 'running' then redis.call('HSET', KEYS[1], 'started_at', ARGV[3]) end
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'finished_at', ARGV[3]) end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'outputs', ARGV[6]) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'type', 'state', 'data',
  cjson.encode({state=ARGV[2], previous=state, error=ARGV[5], at=tonumber(ARGV[3])}))
return {'OK', state}
"""

_COMPLETE_TASK = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[2], ARGV[i], ARGV[i+1]) end
redis.call('HINCRBYFLOAT', KEYS[2], 'tasks', 1)
return 1
"""

# KEYS: record keys; ARGV[1]: '1' to include the spec. Per job: record, counters, totals (flat lists).
READ_RECORDS = """
local out = {}
for i, key in ipairs(KEYS) do
  local rec = redis.call('HGETALL', key)
  if ARGV[1] ~= '1' then
    local kept = {}
    for j = 1, #rec, 2 do
      if rec[j] ~= 'spec' then kept[#kept + 1] = rec[j]; kept[#kept + 1] = rec[j + 1] end
    end
    rec = kept
  end
  out[i] = {rec, redis.call('HGETALL', key .. ':counters'), redis.call('HGETALL', key .. ':totals')}
end
return out
"""


@dataclass(frozen=True)
class JobKeys:
    """The Redis keys of one job: its record, and ``<record>:<name>`` for each other field."""

    record: str
    counters: str
    totals: str
    done: str
    events: str
    cancel: str
    live: str
    """Generation's live shard progress (see ``dfp_generation.live``)."""
    metrics: str
    """Training metric points, scored by step (see :meth:`JobStore.add_metrics`)."""

    @classmethod
    def of(cls, job_id: str) -> JobKeys:
        record = f"dfp:job:{job_id}"
        return cls(record, **{f.name: f"{record}:{f.name}" for f in fields(cls) if f.name != "record"})


class JobStore:
    """Create, read, list and move jobs through their state machine; count progress."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._transition = client.register_script(_TRANSITION)
        self._complete = client.register_script(_COMPLETE_TASK)
        self._read_records = client.register_script(READ_RECORDS)

    @staticmethod
    def keys(job_id: str) -> JobKeys:
        return JobKeys.of(job_id)

    # reads shared with the async readers (dfp_api.store): the command here, the decoding here

    @staticmethod
    def records_request(job_ids: list[str], *, spec: bool = True) -> dict:
        """``keys`` and ``args`` of :data:`READ_RECORDS` for these jobs."""
        return {"keys": [JobStore.keys(job_id).record for job_id in job_ids], "args": ["1" if spec else "0"]}

    @staticmethod
    def decode_records(rows: list) -> list[JobRecord | None]:
        """The records of a :data:`READ_RECORDS` reply, in order; None for a job that does not exist."""
        pairs = lambda flat: dict(zip(flat[::2], flat[1::2]))  # noqa: E731
        return [JobStore._record(pairs(rec), pairs(counters), pairs(totals)) if rec else None
                for rec, counters, totals in rows]

    @staticmethod
    def events_request(job_id: str, after: str = "0-0", block_ms: int | None = None, count: int = 100) -> dict:
        """Arguments of the ``XREAD`` of a job's events after stream id ``after`` (waiting up to
        ``block_ms`` for the first; None: not at all)."""
        return {"streams": {JobStore.keys(job_id).events: after}, "count": count, "block": block_ms}

    @staticmethod
    def decode_events(reply) -> list[tuple[str, str, dict]]:
        """The events of an ``XREAD`` reply as (id, type, data)."""
        rows = reply[0][1] if reply else []
        return [(i, f.get("type", ""), json.loads(f.get("data") or "{}")) for i, f in rows]

    @staticmethod
    def metrics_request(job_id: str, after_step: int = -1, limit: int = METRICS_PAGE_MAX) -> dict:
        """Arguments of the ``ZRANGEBYSCORE`` of a job's metric points after ``after_step``, oldest first."""
        limit = max(1, min(int(limit), METRICS_PAGE_MAX))
        return {"name": JobStore.keys(job_id).metrics, "min": f"({int(after_step)}", "max": "+inf",
                "start": 0, "num": limit}

    @staticmethod
    def decode_metrics(reply) -> list[dict]:
        """The points of a :meth:`metrics_request` reply."""
        return [json.loads(row) for row in reply]

    @staticmethod
    def queue_task_flags(pipe, job_id: str, task_keys: list[str]) -> None:
        """Queue on ``pipe`` what :meth:`is_cancelled` and :meth:`is_task_done` read, for several tasks of
        one job: two replies, the job's cancel flag and the tasks' done flags."""
        keys = JobStore.keys(job_id)
        pipe.exists(keys.cancel)
        pipe.smismember(keys.done, task_keys)

    # create / read

    def create(self, job_type: str, spec: dict, *, job_id: str | None = None, idempotency_key: str | None = None,
               parent_id: str | None = None, stage: str | None = None, primary_unit: str = "tasks",
               totals: dict | None = None, owner: str | None = None) -> tuple[JobRecord, bool]:
        """Create a queued job. With an idempotency key already used, returns that job and False."""
        job_id = job_id or uuid.uuid4().hex[:16]
        if idempotency_key:
            idem = IDEMPOTENCY_PREFIX + idempotency_key
            if not self.r.set(idem, job_id, nx=True, ex=7 * 24 * 3600):
                existing = self.r.get(idem)
                return self.get(existing), False
        now = time.time()
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys(job_id).record, mapping={
            "id": job_id, "type": job_type, "state": JobState.queued.value, "spec": json.dumps(spec),
            "created_at": repr(now), "primary_unit": primary_unit, "outputs": "{}",
            **({"parent_id": parent_id} if parent_id else {}), **({"stage": stage} if stage else {}),
            **({"owner": owner} if owner else {}),
        })
        if totals:
            pipe.hset(self.keys(job_id).totals, mapping={k: float(v) for k, v in totals.items()})
        pipe.zadd(JOBS_INDEX, {job_id: now})
        pipe.xadd(self.keys(job_id).events, {"type": "state", "data": json.dumps({"state": "queued", "at": now})},
                  maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.execute()
        return self.get(job_id), True

    def get(self, job_id: str) -> JobRecord:
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys(job_id).record)
        pipe.hgetall(self.keys(job_id).counters)
        pipe.hgetall(self.keys(job_id).totals)
        rec, counters, totals = pipe.execute()
        if not rec:
            raise JobNotFound(job_id)
        return self._record(rec, counters, totals)

    @staticmethod
    def _record(rec: dict, counters: dict, totals: dict) -> JobRecord:
        num = lambda v: float(v) if v not in (None, "") else None  # noqa: E731
        return JobRecord(
            id=rec["id"], type=rec["type"], state=JobState(rec["state"]), spec=json.loads(rec.get("spec") or "{}"),
            created_at=float(rec["created_at"]), started_at=num(rec.get("started_at")),
            finished_at=num(rec.get("finished_at")), error=rec.get("error") or None,
            outputs=json.loads(rec.get("outputs") or "{}"),
            counters={k: _num(v) for k, v in counters.items()}, totals={k: _num(v) for k, v in totals.items()},
            primary_unit=rec.get("primary_unit") or "tasks", parent_id=rec.get("parent_id"), stage=rec.get("stage"),
            owner=rec.get("owner"),
        )

    def list(self, *, state: str | None = None, job_type: str | None = None, owner: str | None = None,
             offset: int = 0, limit: int = 50, spec: bool = True) -> tuple[list[JobRecord], int]:
        """Newest first, filtered (``owner``: only that principal's jobs); returns (page, total matching).
        With ``spec=False`` the page's records are read in one call without their specs (left ``{}``)."""
        ids = self.r.zrevrange(JOBS_INDEX, 0, -1)
        pipe = self.r.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(self.keys(job_id).record, "state", "type", "owner")
        matching = [job_id for job_id, (st, ty, ow) in zip(ids, pipe.execute())
                    if st is not None and (state is None or st == state) and (job_type is None or ty == job_type)
                    and (owner is None or ow == owner)]
        page = []
        if not spec:
            chosen = matching[offset:offset + limit]
            rows = self._read_records(**self.records_request(chosen, spec=False)) if chosen else []
            return [rec for rec in self.decode_records(rows) if rec is not None], len(matching)
        for job_id in matching[offset:offset + limit]:
            try:
                page.append(self.get(job_id))
            except JobNotFound:
                continue
        return page, len(matching)

    # state machine

    def transition(self, job_id: str, new_state: JobState | str, *, error: str | None = None,
                   outputs: dict | None = None) -> JobRecord:
        """Move the job to ``new_state``; ``error`` is stored without control characters (it may quote
        what a user supplied, and views print it to terminals)."""
        new_state = JobState(new_state)
        allowed_from = {s.value: True for s, targets in ALLOWED.items() if new_state in targets}
        res = self._transition(
            keys=[self.keys(job_id).record, self.keys(job_id).events],
            args=[json.dumps(allowed_from), new_state.value, repr(time.time()), "1" if new_state.terminal else "0",
                  printable(error or ""), json.dumps(outputs) if outputs is not None else "", EVENTS_MAXLEN],
        )
        if res[0] == "ILLEGAL":
            raise IllegalTransition(job_id, res[1], new_state.value)
        return self.get(job_id)

    def start(self, job_id: str) -> bool:
        """Move a queued job to running; False if it was not queued (already started, or finished)."""
        try:
            self.transition(job_id, JobState.running)
            return True
        except IllegalTransition:
            return False

    def set_outputs(self, job_id: str, **outputs) -> None:
        rec = self.get(job_id)
        self.r.hset(self.keys(job_id).record, "outputs", json.dumps({**rec.outputs, **outputs}))

    def cancel(self, job_id: str) -> JobRecord:
        """Cancel a queued or running job: workers stop taking its tasks. 409-style error if finished."""
        rec = self.transition(job_id, JobState.cancelled)
        self.r.set(self.keys(job_id).cancel, "1", ex=30 * 24 * 3600)
        return rec

    def is_cancelled(self, job_id: str) -> bool:
        return bool(self.r.exists(self.keys(job_id).cancel))

    # progress

    def set_totals(self, job_id: str, **totals: float) -> None:
        if totals:
            self.r.hset(self.keys(job_id).totals, mapping={k: float(v) for k, v in totals.items()})

    def add_progress(self, job_id: str, **deltas: float) -> None:
        """Plain increments (not exactly-once); use :meth:`complete_task` for per-task totals."""
        pipe = self.r.pipeline(transaction=False)
        for k, v in deltas.items():
            pipe.hincrbyfloat(self.keys(job_id).counters, k, v)
        pipe.execute()

    def set_counters(self, job_id: str, **values: float) -> None:
        if values:
            self.r.hset(self.keys(job_id).counters, mapping={k: float(v) for k, v in values.items()})

    def complete_task(self, job_id: str, task_key: str, **deltas: float) -> bool:
        """Count a finished task and its counters exactly once; False if it was already counted."""
        args = [task_key]
        for k, v in deltas.items():
            args += [k, float(v)]
        return bool(self._complete(keys=[self.keys(job_id).done, self.keys(job_id).counters], args=args))

    def is_task_done(self, job_id: str, task_key: str) -> bool:
        return bool(self.r.sismember(self.keys(job_id).done, task_key))

    def all_tasks_done(self, job_id: str) -> bool:
        rec = self.get(job_id)
        total = rec.totals.get("tasks")
        return total is not None and rec.counters.get("tasks", 0) >= total

    # events

    def emit(self, job_id: str, event_type: str, data: dict) -> None:
        self.r.xadd(self.keys(job_id).events, {"type": event_type, "data": json.dumps(data)},
                    maxlen=EVENTS_MAXLEN, approximate=True)

    def add_metrics(self, job_id: str, point: dict) -> None:
        """Record a training metric point (``point["step"]``, an int, and numbers) and send it as a
        ``metrics`` event. A point replaces those at its step and after (a resumed run re-logs them);
        only the newest :data:`METRICS_MAXLEN` are kept."""
        step, keys = int(point["step"]), self.keys(job_id)
        pipe = self.r.pipeline(transaction=True)
        pipe.zremrangebyscore(keys.metrics, step, "+inf")
        pipe.zadd(keys.metrics, {json.dumps(point, sort_keys=True): step})
        pipe.zremrangebyrank(keys.metrics, 0, -(METRICS_MAXLEN + 1))
        pipe.xadd(keys.events, {"type": "metrics", "data": json.dumps(point)}, maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.execute()

    def metrics(self, job_id: str, after_step: int = -1, limit: int = METRICS_PAGE_MAX) -> list[dict]:
        """Metric points after ``after_step``, oldest first, at most ``limit`` (and :data:`METRICS_PAGE_MAX`)."""
        return self.decode_metrics(self.r.zrangebyscore(**self.metrics_request(job_id, after_step, limit)))

    def events(self, job_id: str, after: str = "0-0", block_ms: int | None = None, count: int = 100) -> list[tuple[str, str, dict]]:
        """Events after stream id ``after``: (id, type, data)."""
        return self.decode_events(self.r.xread(**self.events_request(job_id, after, block_ms, count)))


def _num(v: str) -> float | int:
    f = float(v)
    return int(f) if f.is_integer() else f
