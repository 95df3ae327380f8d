"""The concurrent input pipeline: build -> fetch hidden states -> host-to-device copy -> (the step).

Each stage runs on its own thread and hands work to the next through a bounded queue, so a slow
stage back-pressures the ones before it and memory stays bounded:

* **build** iterates the work items (batches already collated, pinned on CUDA hosts);
* **fetch** runs an asyncio loop keeping up to ``inflight`` hidden-state requests in flight to the
  :class:`~dfp_shared.hidden_states.HiddenStateSource` (the target service or the in-process
  target), emitting results in order;
* **copy** moves the tensors to the training device on a side CUDA stream (a pass-through on CPU);
* the training loop consumes with ``next(pipeline)``; the time it spends blocked there is the
  data wait, reported as a fraction of wall time.

An exception in any stage is re-raised in the consumer (a refused cache file as itself, a
:class:`~dfp_shared.hidden_states.CacheError` naming the file, so the job fails with that reason);
``close()`` stops every thread.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from dfp_shared.hidden_states import CacheError

from ...drafter.batch import Batch

_END = object()


class _Failure:
    def __init__(self, exc: BaseException, stage: str):
        self.exc, self.stage = exc, stage


class PipelineStopped(Exception):
    """The pipeline was closed while a stage was waiting."""


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _get(q: queue.Queue, stop: threading.Event) -> Any:
    while not stop.is_set():
        try:
            return q.get(timeout=0.05)
        except queue.Empty:
            continue
    raise PipelineStopped()


@dataclass
class StageStats:
    """Seconds each stage spent working (not waiting on its queues), and items it handled."""

    busy_s: dict = field(default_factory=lambda: collections.defaultdict(float))
    items: dict = field(default_factory=lambda: collections.defaultdict(int))


class Pipeline:
    """Run ``items`` through fetch and copy stages concurrently; iterate it to get finished items."""

    def __init__(self, items: Iterable[Any], fetch: Callable[[Any], Awaitable[Any]] | None = None,
                 copy: Callable[[Any], Any] | None = None, *, inflight: int = 4, queue_size: int = 4):
        self._items = items
        self._fetch = fetch
        self._copy = copy
        self.inflight = max(1, inflight)
        self._stop = threading.Event()
        self._q_built: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._q_fetched: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._q_ready: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self.stats = StageStats()
        self.wait_s = 0.0
        self._started = None
        self._done = False
        self._threads = [
            threading.Thread(target=self._build, name="pipeline-build", daemon=True),
            threading.Thread(target=self._fetch_loop, name="pipeline-fetch", daemon=True),
            threading.Thread(target=self._copy_loop, name="pipeline-copy", daemon=True),
        ]

    # lifecycle

    def start(self) -> Pipeline:
        if self._started is None:
            self._started = time.perf_counter()
            for t in self._threads:
                t.start()
        return self

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=5)

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # consumer side

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        self.start()
        t0 = time.perf_counter()
        try:
            item = _get(self._q_ready, self._stop)
        except PipelineStopped:
            raise StopIteration from None
        finally:
            self.wait_s += time.perf_counter() - t0
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            self.close()
            if isinstance(item.exc, CacheError):  # bad input, not a fault of the pipeline: its own reason
                raise item.exc
            raise RuntimeError(f"input pipeline stage {item.stage!r} failed: {item.exc}") from item.exc
        return item

    # stages

    def _build(self) -> None:
        out = self._q_built
        try:
            it = iter(self._items)
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    break
                self.stats.busy_s["build"] += time.perf_counter() - t0
                self.stats.items["build"] += 1
                if not _put(out, item, self._stop):
                    return
            _put(out, _END, self._stop)
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            _put(out, _Failure(exc, "build"), self._stop)

    def _fetch_loop(self) -> None:
        if self._fetch is None:
            self._forward(self._q_built, self._q_fetched, None, "fetch")
            return
        try:
            asyncio.run(self._fetch_async())
        except PipelineStopped:
            return
        except BaseException as exc:  # noqa: BLE001
            _put(self._q_fetched, _Failure(exc, "fetch"), self._stop)

    async def _timed_fetch(self, item: Any) -> Any:
        t0 = time.perf_counter()
        result = await self._fetch(item)
        self.stats.busy_s["fetch"] += time.perf_counter() - t0
        self.stats.items["fetch"] += 1
        return result

    async def _fetch_async(self) -> None:
        """Keep up to ``inflight`` fetches running; emit results in input order."""
        pending: collections.deque = collections.deque()
        getter = None
        exhausted = False
        while True:
            if getter is None and not exhausted and len(pending) < self.inflight:
                getter = asyncio.ensure_future(asyncio.to_thread(_get, self._q_built, self._stop))
            waits = {w for w in (getter, pending[0] if pending else None) if w is not None}
            if not waits:
                break
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if pending and pending[0].done():
                result = pending.popleft().result()
                if not await asyncio.to_thread(_put, self._q_fetched, result, self._stop):
                    raise PipelineStopped()
            if getter is not None and getter.done():
                item = getter.result()
                getter = None
                if item is _END:
                    exhausted = True
                elif isinstance(item, _Failure):
                    for p in pending:
                        p.cancel()
                    _put(self._q_fetched, item, self._stop)
                    return
                else:
                    pending.append(asyncio.ensure_future(self._timed_fetch(item)))
        _put(self._q_fetched, _END, self._stop)

    def _copy_loop(self) -> None:
        self._forward(self._q_fetched, self._q_ready, self._copy, "copy")

    def _forward(self, src: queue.Queue, dst: queue.Queue, fn: Callable | None, stage: str) -> None:
        try:
            while True:
                item = _get(src, self._stop)
                if item is _END or isinstance(item, _Failure):
                    _put(dst, item, self._stop)
                    return
                if fn is not None:
                    t0 = time.perf_counter()
                    item = fn(item)
                    self.stats.busy_s[stage] += time.perf_counter() - t0
                self.stats.items[stage] += 1
                if not _put(dst, item, self._stop):
                    return
        except PipelineStopped:
            return
        except BaseException as exc:  # noqa: BLE001
            _put(dst, _Failure(exc, stage), self._stop)

    # reporting

    def data_wait_fraction(self) -> float:
        """Share of the consumer's wall time spent waiting for the next item."""
        if self._started is None:
            return 0.0
        elapsed = time.perf_counter() - self._started
        return min(1.0, self.wait_s / elapsed) if elapsed > 0 else 0.0

    def busy_fraction(self, stage: str) -> float:
        """Share of the wall time since the start that ``stage`` spent working (it runs beside the consumer,
        so the shares of a stage and of the consumer's steps may add up to more than one)."""
        if self._started is None:
            return 0.0
        elapsed = time.perf_counter() - self._started
        return min(1.0, self.stats.busy_s[stage] / elapsed) if elapsed > 0 else 0.0


class WaitMeter:
    """Data-wait fraction over a sliding window of steps (for progress reports)."""

    def __init__(self, window: int = 50):
        self.samples: collections.deque = collections.deque(maxlen=window)

    def add(self, wait_s: float, step_s: float) -> None:
        self.samples.append((wait_s, step_s))

    def fraction(self) -> float:
        total = sum(s for _, s in self.samples)
        return sum(w for w, _ in self.samples) / total if total > 0 else 0.0


# device copy used by the trainer


class DeviceCopier:
    """Host->device copies on a side CUDA stream; ``wait()`` makes the compute stream wait for them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, batch: Batch) -> tuple[Batch, Any]:
        if self.stream is None:
            return batch, None
        with torch.cuda.stream(self.stream):
            moved = batch.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return moved, event

    @staticmethod
    def wait(event, batch: Batch) -> None:
        """Order the compute stream after the copy, and keep the memory alive until compute used it."""
        if event is None:
            return
        current = torch.cuda.current_stream()
        current.wait_event(event)
        for t in batch.tensors():
            t.record_stream(current)
