"""Async reads of job records and event streams for the request path.

Writes (submit, cancel) go through the shared sync :class:`~dfp_shared.jobs.store.JobStore` and
:mod:`dfp_shared.jobs.submit` in a thread; the hot reads (``GET /v1/jobs/{id}``, event streams, rate
limits) use ``redis.asyncio`` so they never block the event loop. The commands' keys and arguments
and the decoding of their replies come from ``JobStore``, so the key layout lives in one place.

Record reads are batched: every ``get`` issued in one event-loop turn waits for one Lua call that
reads all of them (record, counters, totals) in a single round trip. Each read still starts after
its request arrived, so nothing is served stale; under load, the client-side cost of a Redis
command (most of a request's CPU) is shared by the whole batch. The keys of one batch must live
on one Redis node (a single Redis or a primary with replicas, as the chart deploys; not Cluster).
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from dfp_shared.jobs.store import READ_RECORDS, JobNotFound, JobRecord, JobStore


class AsyncJobReader:
    def __init__(self, client: aioredis.Redis, max_batch: int = 512):
        self.r = client
        self.max_batch = max_batch
        self._read_many = client.register_script(READ_RECORDS)
        self._waiting: dict[str, list[asyncio.Future]] = {}
        self._flush_scheduled = False
        self._inflight: set[asyncio.Task] = set()

    async def get(self, job_id: str) -> JobRecord:
        """The job's record (raises JobNotFound), read in this loop turn's batch."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.setdefault(job_id, []).append(future)
        if len(self._waiting) >= self.max_batch:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._waiting:
            return
        batch, self._waiting = self._waiting, {}
        task = asyncio.ensure_future(self._read(batch))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _read(self, batch: dict[str, list[asyncio.Future]]) -> None:
        ids = list(batch)
        try:
            rows = await self._read_many(**JobStore.records_request(ids))
        except BaseException as exc:  # every waiter gets the error (Redis down -> 503)
            for futures in batch.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for job_id, rec in zip(ids, JobStore.decode_records(rows)):
            result: JobRecord | Exception = rec if rec is not None else JobNotFound(job_id)
            for future in batch[job_id]:
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def events(self, job_id: str, after: str, block_ms: int | None,
                     count: int = 100) -> list[tuple[str, str, dict]]:
        """Events after stream id ``after`` as (id, type, data); waits up to ``block_ms`` for the first."""
        return JobStore.decode_events(await self.r.xread(**JobStore.events_request(job_id, after, block_ms, count)))

    async def metrics(self, job_id: str, after_step: int, limit: int) -> list[dict]:
        """Metric points after ``after_step``, oldest first, at most ``limit``."""
        return JobStore.decode_metrics(await self.r.zrangebyscore(**JobStore.metrics_request(job_id, after_step, limit)))
