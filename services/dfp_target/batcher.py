"""Dynamic batching: sequences from concurrent callers share one forward under a token budget.

Callers :meth:`DynamicBatcher.submit` their sequences and get one future per sequence. One
thread (the only one that ever runs the model) takes sequences in arrival order, waits up to
``max_wait_s`` for more while the padded batch (rows x longest) stays within ``max_batch_tokens``,
runs the forward for the union of the requested layers, and hands each sequence its own layers.
The queue is bounded in tokens: a submit that would exceed ``max_queue_tokens`` raises
:class:`QueueFull` at once (the service answers RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from dfp_shared.hidden_states import padded_batches

from . import metrics

log = logging.getLogger(__name__)

RunFn = Callable[[list[torch.Tensor], list[int]], list[torch.Tensor]]


class QueueFull(RuntimeError):
    pass


class BatcherClosed(RuntimeError):
    pass


@dataclass
class _Item:
    tokens: torch.Tensor
    layer_ids: list[int]
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


class DynamicBatcher:
    def __init__(self, run: RunFn, hidden_size: int, *, max_batch_tokens: int = 8192, max_wait_s: float = 0.002,
                 max_queue_tokens: int = 262144, on_batch: Callable[[], None] | None = None):
        self.run = run
        self.hidden_size = hidden_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue_tokens = max_queue_tokens
        self.on_batch = on_batch
        self._queue: deque[_Item] = deque()
        self._queued_tokens = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="target-batcher", daemon=True)
        self._thread.start()

    def queued_tokens(self) -> int:
        return self._queued_tokens

    def submit(self, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[Future]:
        """One future per sequence, resolved with its (len, K*H) tensor; raises QueueFull / BatcherClosed."""
        items = [_Item(seq, layer_ids) for seq in sequences]
        tokens = sum(i.length for i in items)
        with self._cond:
            if self._closing:
                raise BatcherClosed("the target is shutting down")
            if self._queued_tokens and self._queued_tokens + tokens > self.max_queue_tokens:
                metrics.REJECTED.inc()
                raise QueueFull(f"queue full: {self._queued_tokens} tokens waiting, limit {self.max_queue_tokens}; "
                                "retry later")
            self._queue.extend(items)
            self._queued_tokens += tokens
            metrics.QUEUE_TOKENS.set(self._queued_tokens)
            self._cond.notify()
        return [i.future for i in items]

    def close(self, timeout: float | None = None) -> None:
        """Finish what is queued, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ batching thread

    def _take_batch(self) -> list[_Item]:
        with self._cond:
            while not self._queue:
                if self._closing:
                    return []
                self._cond.wait(0.5)
            deadline = time.monotonic() + self.max_wait_s
            while True:
                count = len(next(padded_batches((item.length for item in self._queue), self.max_batch_tokens)))
                full = count < len(self._queue)
                remaining = deadline - time.monotonic()
                if full or remaining <= 0 or self._closing:
                    break
                self._cond.wait(remaining)
            batch = [self._queue.popleft() for _ in range(count)]
            self._queued_tokens -= sum(i.length for i in batch)
            metrics.QUEUE_TOKENS.set(self._queued_tokens)
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                return
            live = [i for i in batch if i.future.set_running_or_notify_cancel()]
            if not live:
                continue
            now = time.monotonic()
            for item in live:
                metrics.QUEUE_WAIT.observe(now - item.enqueued)
            self._run(live)
            if self.on_batch:
                self.on_batch()

    def _run(self, batch: list[_Item]) -> None:
        union = sorted({layer for item in batch for layer in item.layer_ids})
        started = time.monotonic()
        try:
            states = self.run([i.tokens for i in batch], union)
        except Exception as exc:  # noqa: BLE001 - delivered to every caller of the batch
            log.exception("forward failed")
            for item in batch:
                item.future.set_exception(exc)
            return
        elapsed = time.monotonic() - started
        tokens = sum(i.length for i in batch)
        metrics.observe_batch(len(batch), tokens, max(i.length for i in batch) * len(batch), elapsed)
        h = self.hidden_size
        column = {layer: k for k, layer in enumerate(union)}
        for item, full in zip(batch, states):
            if item.layer_ids == union:
                item.future.set_result(full)
            else:
                parts = [full[:, column[layer] * h:(column[layer] + 1) * h] for layer in item.layer_ids]
                item.future.set_result(torch.cat(parts, dim=-1))
