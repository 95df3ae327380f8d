"""Server-sent events of one job: its event stream in Redis plus progress snapshots.

Events recorded by the job code (``state``, ``stage``, and whatever workers ``emit``) are relayed
with their stream id as the SSE id, so a client resumes with ``Last-Event-ID``. Between them the
stream checks the job's counters and sends a ``progress`` event when they changed (for a pipeline,
also its current stage's counters, included as ``stage``). When the job
is terminal the stream sends ``end`` (final state, error, outputs) and closes.

A stream may stay open long after the request that opened it was authenticated, so at every poll
``still_allowed`` re-checks the caller's key against the current key set and the job; when it no
longer holds, the stream sends ``unauthorized`` (``{"error": "unauthenticated", "message"}``) and
closes, before relaying anything more.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from dfp_shared.jobs.store import JobNotFound, JobRecord
from dfp_shared.jobs.types import PIPELINE
from dfp_shared.specs import PipelineSpec
from fastapi.sse import ServerSentEvent

from .store import AsyncJobReader

PROGRESS_MIN_INTERVAL_S = 0.25


STAGES_LATEST_FIRST = tuple(reversed(PipelineSpec.STAGES))


def _progress(rec: JobRecord, stage: JobRecord | None) -> dict:
    out = {"state": rec.state.value, "counters": rec.counters, "totals": rec.totals, "progress": rec.progress()}
    if stage is not None:
        out["stage"] = {"name": stage.stage, "job_id": stage.id, "state": stage.state.value,
                        "progress": stage.progress()}
    return out


async def _current_stage(reader: AsyncJobReader, rec: JobRecord) -> JobRecord | None:
    """A pipeline's latest stage job (its progress is the pipeline's detail), else None."""
    if rec.type != PIPELINE.name:
        return None
    for stage in STAGES_LATEST_FIRST:
        job_id = rec.outputs.get(f"{stage}_job")
        if job_id:
            try:
                return await reader.get(job_id)
            except JobNotFound:
                return None
    return None


async def job_events(reader: AsyncJobReader, job_id: str, *, after: str = "0-0", poll_s: float = 1.0,
                     max_s: float = 3600.0,
                     still_allowed: Callable[[JobRecord], str | None] | None = None,
                     on_poll: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[ServerSentEvent]:
    deadline = time.monotonic() + max_s
    cursor = after
    last_seen = None
    last_sent = 0.0
    while True:
        rows = await reader.events(job_id, cursor, block_ms=max(1, int(poll_s * 1000)))
        if on_poll is not None:
            await on_poll()
        rec = await reader.get(job_id)
        if still_allowed is not None and (reason := still_allowed(rec)) is not None:
            yield ServerSentEvent(event="unauthorized", data={"error": "unauthenticated", "message": reason})
            return
        for event_id, event_type, data in rows:
            cursor = event_id
            yield ServerSentEvent(event=event_type or "message", id=event_id, data=data)
        stage = await _current_stage(reader, rec)
        seen = (rec.state, rec.counters, rec.totals,
                (stage.id, stage.state, stage.counters, stage.totals) if stage else None)
        now = time.monotonic()
        if seen != last_seen and (rec.state.terminal or now - last_sent >= PROGRESS_MIN_INTERVAL_S):
            last_seen, last_sent = seen, now
            yield ServerSentEvent(event="progress", data=_progress(rec, stage))
        if rec.state.terminal:
            while rows := await reader.events(job_id, cursor, block_ms=None, count=1000):
                for event_id, event_type, data in rows:
                    cursor = event_id
                    yield ServerSentEvent(event=event_type or "message", id=event_id, data=data)
            yield ServerSentEvent(event="end", data={"state": rec.state.value, "error": rec.error,
                                                     "outputs": rec.outputs})
            return
        if now >= deadline:
            return
