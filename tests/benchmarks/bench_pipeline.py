"""Training-step throughput of the concurrent input pipeline (steps/s) and the data-wait fraction.

Stage costs are simulated so that the hidden-state fetch and the optimiser step take equal time
(``--cost`` seconds each): the fetch is a :class:`HiddenStateSource` whose ``hidden_states``
awaits that long (a remote target service answering), the step sleeps that long (a GPU step,
which releases the GIL as CUDA kernels do). Batch building (``collate``) and the padded
hidden-state assembly (``fetch_hidden``) are the trainer's real code on a synthetic dataset.

Project: ``dfp_trainer.components.data.stages.Pipeline`` — build, fetch (several requests in flight), copy and
step concurrently. Baseline: the same stages one after another. Limit: the slowest stage alone
(the step, ``1 / cost`` steps/s).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from _common import report
from dfp_shared.records.token_shards import TokenDataset
from dfp_trainer.components.data.collate import collate, fetch_hidden
from dfp_trainer.components.data.dataset import BatchSampler
from dfp_trainer.components.data.stages import DeviceCopier, Pipeline


class SimulatedTarget:
    """A hidden-state source answering after ``cost`` seconds with (len, K*H) zeros."""

    def __init__(self, cost: float, width: int):
        self.cost, self.width = cost, width

    async def hidden_states(self, sequences, layer_ids):
        await asyncio.sleep(self.cost)
        return [torch.zeros(int(s.numel()), self.width) for s in sequences]


def dataset(num: int = 4000) -> TokenDataset:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 512, (num,), generator=g)
    offsets = torch.zeros(num + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    n = int(offsets[-1])
    return TokenDataset(torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32), torch.ones(n, dtype=torch.uint8),
                        offsets, [f"s{i}" for i in range(num)], {})


def batches(ds: TokenDataset, steps: int):
    sampler = BatchSampler(ds.lengths, 4096, seed=0)
    for (idx, _), _ in zip(sampler, range(steps), strict=False):
        yield collate(ds, idx, 3072)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--cost", type=float, default=0.03, help="Seconds of the fetch and of the step (each).")
    ap.add_argument("--inflight", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ds = dataset()
    source = SimulatedTarget(args.cost, width=64)
    copier = DeviceCopier(torch.device("cpu"))

    async def fetch(batch):
        batch.target_hidden = await fetch_hidden(source, batch.sequences(), [1, 2], None)
        return batch

    def copy(batch):
        return copier(batch)

    def step(_tensors):
        time.sleep(args.cost)

    # project: concurrent stages
    t0 = time.perf_counter()
    with Pipeline(batches(ds, args.steps), fetch, copy, inflight=args.inflight, queue_size=4) as pipe:
        for batch, event in pipe:
            DeviceCopier.wait(event, batch)
            step(batch)
        wait = pipe.data_wait_fraction()
    project = args.steps / (time.perf_counter() - t0)

    # baseline: the same stages one after another
    t0 = time.perf_counter()
    for batch in batches(ds, args.steps):
        moved, _ = copy(asyncio.run(fetch(batch)))
        step(moved)
    baseline = args.steps / (time.perf_counter() - t0)

    # limit: the slowest stage (the step) alone
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(None)
    limit = args.steps / (time.perf_counter() - t0)
    report("pipeline", "steps/s", project, baseline, limit, data_wait_fraction=round(wait, 4),
           stage_cost_s=args.cost, steps=args.steps, inflight=args.inflight)


if __name__ == "__main__":
    main()
