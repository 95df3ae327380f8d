"""The run's micro-batches through the input pipeline (:mod:`..components.data.stages`): planned by the sampler from the
state's step on, split per rank and accumulation step, collated, given their target features by the
hidden-state source, copied to the training device."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..components.data.collate import collate, fetch_hidden
from ..components.data.dataset import micro_batches, rank_share
from ..components.data.stages import DeviceCopier, Pipeline
from ..components.distributed import DistInfo
from ..drafter.batch import Batch
from ..run_config import RunConfig
from .prepare import Setup
from .state import TrainState


@dataclass
class Item:
    """One micro-batch in the pipeline and its place in training."""

    step: int
    micro: int
    shard: int
    last: bool  # the step's last micro-batch: gradients sync, the optimiser steps
    sampler_state: dict  # resumes right after this step's batch
    batch: Batch
    event: Any = None  # the host-to-device copy's CUDA event


def items(state: TrainState, s: Setup, info: DistInfo) -> Iterator[Item]:
    """This rank's micro-batches of every step from ``state.step`` to the end of the run."""
    spec, world = s.spec, info.world_size
    accum = spec.grad_accum
    for global_step, (idx, after) in enumerate(state.sampler, start=state.step):
        if global_step >= state.total:
            return
        parts = micro_batches(rank_share(idx, info.rank, world), accum)
        for k, part in enumerate(parts):
            batch = collate(s.dataset, part, spec.max_length, pin=info.device.type == "cuda")
            yield Item(global_step, k, info.rank + world * k, k == accum - 1, after, batch)


def input_pipeline(config: RunConfig, state: TrainState, s: Setup, info: DistInfo) -> Pipeline:
    """The pipeline of :func:`items`: build -> fetch the target features -> copy to the device."""
    pin = info.device.type == "cuda"

    async def fetch(item: Item) -> Item:
        item.batch.target_hidden = await fetch_hidden(s.source, item.batch.sequences(), s.fetched_layer_ids,
                                                      s.max_tokens_per_request, pin=pin, index=item.batch.index)
        return item

    copier = DeviceCopier(info.device)

    def copy(item: Item) -> Item:
        item.batch, item.event = copier(item.batch)
        return item

    settings = config.settings
    return Pipeline(items(state, s, info), fetch, copy, inflight=settings.fetch_inflight,
                    queue_size=settings.prefetch_batches)
