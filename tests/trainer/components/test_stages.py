"""The concurrent input pipeline: order, bounded concurrency, errors, data-wait fraction."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from dfp_trainer.components.data.collate import fetch_hidden
from dfp_trainer.components.data.stages import Pipeline
from dfp_trainer.loop.train import summarise


def test_items_arrive_in_order_with_several_fetches_in_flight():
    live, peak, lock = [0], [0], threading.Lock()

    async def fetch(x):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        await asyncio.sleep(0.002 * (x % 5))  # out-of-order completion
        with lock:
            live[0] -= 1
        return x * 10

    with Pipeline(range(60), fetch, lambda x: x + 1, inflight=4, queue_size=2) as p:
        out = list(p)
    assert out == [x * 10 + 1 for x in range(60)]
    assert 2 <= peak[0] <= 4


def test_stage_errors_reach_the_consumer():
    async def fetch(x):
        if x == 5:
            raise ValueError("target said no")
        return x

    with Pipeline(range(20), fetch, inflight=2) as p:
        with pytest.raises(RuntimeError, match="fetch.*target said no"):
            list(p)

    def broken():
        yield 1
        raise KeyError("bad shard")

    with Pipeline(broken(), None) as p:
        with pytest.raises(RuntimeError, match="build"):
            list(p)


def test_data_wait_fraction_small_when_fetch_overlaps_and_large_when_it_cannot():
    cost = 0.02

    async def fetch(x):
        await asyncio.sleep(cost)
        return x

    def consume(p):
        for _ in p:
            time.sleep(cost)  # the "optimiser step"
        return p.data_wait_fraction()

    with Pipeline(range(40), fetch, inflight=4, queue_size=4) as p:
        overlapped = consume(p)

    async def slow_fetch(x):
        await asyncio.sleep(cost * 4)
        return x

    with Pipeline(range(10), slow_fetch, inflight=1, queue_size=1) as p:
        starved = consume(p)
        target_bound = p.busy_fraction("fetch")
    assert overlapped < 0.25
    assert starved > 0.5
    assert overlapped < starved
    assert target_bound > 0.5  # a fetch-bound run: the fetch stage was busy most of the time


def test_the_summary_says_which_share_the_drafter_and_the_target_take():
    async def fetch(x):
        await asyncio.sleep(0.03)  # the target's forward, one item in flight: the steps wait on it
        return x

    with Pipeline(range(8), fetch, inflight=1, queue_size=1) as p:
        history = [{"step": i + 1, "loss": 1.0, "accuracy": 0.5, "tokens_per_s": 1.0, "comm_fraction": 0.0,
                    "per_position_accuracy": [0.5]} for i, _ in enumerate(p)]
        summary = summarise(history, p)
    assert summary["drafter_step_fraction"] == pytest.approx(1 - summary["data_wait_fraction"])
    assert summary["target_fetch_fraction"] > summary["drafter_step_fraction"]  # a target-bound run
    assert 0 < summary["target_fetch_fraction"] <= 1


def test_fetch_hidden_pads_and_splits_requests():
    class Source:
        def __init__(self):
            self.requests = []

        async def hidden_states(self, sequences, layer_ids):
            self.requests.append([int(s.numel()) for s in sequences])
            return [s.float().unsqueeze(1).repeat(1, 2 * len(layer_ids)) for s in sequences]

    src = Source()
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    out = asyncio.run(fetch_hidden(src, seqs, [0, 3], max_tokens_per_request=4))
    assert out.shape == (3, 3, 4)
    assert src.requests == [[3, 1], [2]]
    assert out[1, 0].tolist() == [4.0] * 4 and out[1, 1:].abs().sum() == 0
    assert out[2, :2, 0].tolist() == [5.0, 6.0]
