"""Captured exchanges leave the request path here: a bounded in-memory queue, drained by one background task
that reads the kept replies into their exchanges, redacts, encodes and writes them as JSON Lines shards (in
a worker thread), and the retention sweep.

Shard layout under the capture prefix: ``completions/<YYYYMMDDTHH>/<worker>-<boot>-<seq>.jsonl``, one file a
flush, in the UTC hour of the flush (``records_key`` of ``dfp_shared.records.completions`` with the shard name
``<hour>/<worker>-<boot>-<seq>``; the layout's owner is ``dfp_adapt.source``, which reads it back for
training). The retention sweep deletes a shard once its whole hour is older than the
retention. A full queue or a failed write drops the captures (counted); the request path never waits on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from collections import deque
from dataclasses import dataclass

from dfp_shared.records.capture_layout import CAPTURED_AT_FORMAT, HOUR_FORMAT, HOUR_RE
from dfp_shared.records.completions import ID, META, encode_records, records_key
from dfp_shared.storage.store import ObjectStore

from . import metrics
from .assemble import EventReader, Exchange, Unusable, completion_records, settle

log = logging.getLogger(__name__)
REDACTED = "[REDACTED]"


class Redactor:
    """Every scalar of a record, keys and values, with each pattern's matches replaced: strings as they are,
    numbers as their JSON text (a number a pattern matches becomes the redacted string). Booleans and nulls
    carry no text to match and stay; so do the fields the service writes itself (``OWN_META``)."""

    OWN_META = frozenset({"source", "captured_at", "incomplete", "greedy", "endpoint", "choice"})

    def __init__(self, patterns: list[str]):
        self.patterns = [re.compile(p) for p in patterns]

    def text(self, value: str) -> str:
        for pattern in self.patterns:
            value = pattern.sub(REDACTED, value)
        return value

    def __call__(self, value):
        if not self.patterns:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            rendered = json.dumps(value)
            redacted = self.text(rendered)
            return value if redacted == rendered else redacted
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {self.text(k): self(v) for k, v in value.items()}
        return value

    def record(self, record: dict) -> dict:
        """A completion record redacted, less its id and the service's own meta fields."""
        if not self.patterns:
            return record
        meta = {k: v if k in self.OWN_META else self(v) for k, v in record[META].items()}
        return {**{k: v if k == ID else self(v) for k, v in record.items() if k != META}, META: meta}


@dataclass
class Capture:
    """An exchange to write; ``reply``: the reply's bytes still to be read into it (``events``: as a stream)."""

    exchange: Exchange
    captured_at: float
    incomplete: bool
    reply: bytes | None = None
    events: EventReader | None = None

    @property
    def size(self) -> int:
        return self.exchange.size + len(self.reply or b"") + 1024


def hour_of(timestamp: float) -> str:
    return time.strftime(HOUR_FORMAT, time.gmtime(timestamp))


class CaptureWriter:
    """The bounded queue and the task that writes it out (start it inside the server's event loop)."""

    def __init__(self, store: ObjectStore, redactor: Redactor, *, worker: str, max_records: int, max_bytes: int,
                 max_record_bytes: int, flush_interval_s: float, retention_hours: float, sweep_interval_s: float):
        self.store, self.redact, self.worker = store, redactor, worker
        self.max_records, self.max_bytes, self.max_record_bytes = max_records, max_bytes, max_record_bytes
        self.flush_interval_s, self.sweep_interval_s = flush_interval_s, sweep_interval_s
        self.retention_s = retention_hours * 3600
        self.boot = secrets.token_hex(4)
        self.seq = 0
        self.queue: deque[Capture] = deque()
        self.queued_bytes = 0
        self.tasks: list[asyncio.Task] = []
        self.wake: asyncio.Event | None = None

    def submit(self, capture: Capture) -> bool:
        """Queue a capture, or drop it (counted) when the queue is full; never blocks."""
        if len(self.queue) >= self.max_records or self.queued_bytes + capture.size > self.max_bytes:
            metrics.dropped("buffer_full")
            return False
        self.queue.append(capture)
        self.queued_bytes += capture.size
        return True

    def start(self) -> None:
        self.wake = asyncio.Event()
        self.tasks = [asyncio.create_task(self._flush_loop()), asyncio.create_task(self._sweep_loop())]

    @property
    def running(self) -> bool:
        return bool(self.tasks) and not any(t.done() for t in self.tasks)

    async def stop(self) -> None:
        """Write what is queued, then end the background tasks."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        await self.flush()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - a failed flush costs its batch, never the captures after it
                log.warning("capture flush failed", exc_info=True)

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.sweep)
            except Exception:  # noqa: BLE001 - a failed sweep is retried at the next interval
                log.warning("retention sweep failed", exc_info=True)
            await asyncio.sleep(self.sweep_interval_s)

    async def flush(self) -> int:
        """Write everything queued now as one shard; returns the records written."""
        batch = list(self.queue)
        self.queue.clear()
        self.queued_bytes = 0
        if not batch:
            return 0
        self.seq += 1
        key = records_key(f"{hour_of(time.time())}/{self.worker}-{self.boot}-{self.seq:06d}")
        return await asyncio.to_thread(self.write_shard, batch, key)

    def encode(self, capture: Capture) -> list[bytes]:
        """A capture's records, redacted and encoded; too large, unusable or unencodable ones are dropped
        (counted)."""
        try:
            return self._encode(capture)
        except Exception as exc:  # noqa: BLE001 - one capture that cannot be written costs only itself
            metrics.dropped("unencodable")
            log.warning("capture not encodable", extra={"error": f"{type(exc).__name__}: {exc}"})
            return []

    def _encode(self, capture: Capture) -> list[bytes]:
        meta = {"source": "capture", "captured_at": time.strftime(CAPTURED_AT_FORMAT, time.gmtime(capture.captured_at)),
                "incomplete": capture.incomplete}
        try:
            if capture.reply is not None:
                settle(capture.exchange, capture.reply, capture.events, whole=not capture.incomplete)
            if not capture.exchange.choices:
                return []
            records = completion_records(capture.exchange, uuid.uuid4().hex, meta)
        except Unusable as exc:
            metrics.dropped(exc.reason)
            return []
        lines = [encode_records([self.redact.record(record)]) for record in records]
        kept = []
        for line in lines:
            if len(line) > self.max_record_bytes:
                metrics.dropped("too_large")
                continue
            kept.append(line)
        return kept

    def write_shard(self, batch: list[Capture], key: str) -> int:
        lines, incomplete = [], 0
        for capture in batch:
            encoded = self.encode(capture)
            lines.extend(encoded)
            incomplete += len(encoded) if capture.incomplete else 0
        if not lines:
            return 0
        data = b"".join(lines)
        try:
            self.store.put(key, data)
        except Exception as exc:  # noqa: BLE001 - storage of any kind failing drops the batch, never the service
            metrics.dropped("storage_error", len(lines))
            log.warning("capture shard not written", extra={"key": key, "error": f"{type(exc).__name__}: {exc}"})
            return 0
        metrics.RECORDS.inc(len(lines))
        metrics.INCOMPLETE.inc(incomplete)
        metrics.BYTES.labels(direction="written").inc(len(data))
        metrics.SHARDS.labels(event="written").inc()
        return len(lines)

    def sweep(self, now: float | None = None) -> list[str]:
        """Delete the shards whose hour ended more than the retention ago; returns their keys."""
        now = time.time() if now is None else now
        cutoff = hour_of(now - self.retention_s - 3600)
        expired = []
        for key in self.store.list("completions/"):
            match = HOUR_RE.match(key)
            if match and match.group(1) <= cutoff:
                self.store.delete(key)
                expired.append(key)
        metrics.SHARDS.labels(event="expired").inc(len(expired))
        return expired
