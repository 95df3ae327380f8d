"""The training step: forward and backward of each micro-batch (gradients sync on the step's last one),
then gradient clipping, the optimiser and the LR schedule."""

from __future__ import annotations

import contextlib

import torch
from dfp_shared.specs.train import TrainSpec

from ..components.data.dataset import step_seed
from ..components.loss import LossRecipe
from ..drafter.objective import dflash_loss
from .inputs import Item
from .state import TrainState


def train_micro_batch(state: TrainState, item: Item, spec: TrainSpec, world_size: int, acc: dict) -> torch.Tensor | None:
    """Forward and backward of ``item`` (its anchors and noise drawn from the run's seed, the step and the
    micro-batch's shard), its numbers added to ``acc``; after the step's last micro-batch also the optimiser
    step. Returns the gradient norm (before clipping) when the optimiser stepped, else None."""
    model = state.model
    gen = torch.Generator().manual_seed(step_seed(spec.seed, item.step, item.shard))
    sync = contextlib.nullcontext() if item.last or world_size == 1 else model.no_sync()
    with sync:
        loss, metrics = dflash_loss(model, item.batch, generator=gen, **LossRecipe.from_spec(spec).kwargs())
        (loss / spec.grad_accum).backward()
    accumulate(acc, metrics, tokens=item.batch.num_tokens)
    if not item.last:
        return None
    grad_norm = torch.nn.utils.clip_grad_norm_(state.params, spec.grad_clip)
    state.optim.step()
    state.sched.step()
    state.optim.zero_grad(set_to_none=True)
    return grad_norm


def accumulate(acc: dict, metrics: dict, tokens: int) -> None:
    """Add a micro-batch's objective numbers to the step's sums in ``acc``."""
    acc["loss_sum"] = acc.get("loss_sum", 0.0) + metrics["loss_sum"]
    acc["weight_sum"] = acc.get("weight_sum", 0.0) + metrics["weight_sum"]
    acc["correct_sum"] = acc.get("correct_sum", 0.0) + metrics["correct_sum"]
    acc["count_sum"] = acc.get("count_sum", 0.0) + metrics["num_trained_tokens"]
    acc["tokens"] = acc.get("tokens", 0) + tokens
    for key in ("per_position_correct", "per_position_count"):
        prev = acc.get(key)
        acc[key] = list(metrics[key]) if prev is None else [a + b for a, b in zip(prev, metrics[key], strict=True)]
