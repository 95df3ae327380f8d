"""Held-out objective metrics of a run: loss, accuracy and accuracy per block position on the
evaluation samples (kept out of training by :func:`~dfp_trainer.loop.prepare.prepare`), for the trained
drafter and for the same drafter at its initial weights.

Hidden states come from the run's own hidden-state source, so the features are those training saw;
anchors are drawn from the run's seed, so both drafters are scored on the same blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator

import torch

from ...drafter.batch import Batch
from ...drafter.objective import dflash_loss
from ...drafter.wrappers import unwrap
from ..data.collate import collate, fetch_hidden


@contextlib.contextmanager
def initial_weights(setup, drafter) -> Iterator[None]:
    """Temporarily load the drafter's initial (untrained) weights; the trained ones come back after."""
    trained = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    drafter.load_state_dict(setup.initial_state)
    try:
        yield
    finally:
        drafter.load_state_dict(trained)


def heldout_batches(setup, device: torch.device, batch_size: int = 4, limit: int | None = None) -> Iterator[Batch]:
    """The evaluation samples (the first ``limit``; None: all) in batches with their target features, on ``device``."""
    index = setup.eval_index[:limit]
    for start in range(0, index.numel(), batch_size):
        batch = collate(setup.dataset, index[start:start + batch_size], setup.spec.max_length)
        batch.target_hidden = asyncio.run(fetch_hidden(setup.source, batch.sequences(), setup.fetched_layer_ids,
                                                       setup.max_tokens_per_request, index=batch.index))
        yield batch.to(device)


def evaluate_heldout(setup, drafter) -> dict:
    """``{"heldout_trained": metrics, "heldout_untrained": metrics}`` (see
    :func:`heldout_metrics`); empty when there are no evaluation samples."""
    if not setup.eval_index.numel():
        return {}
    spec = setup.spec
    device = next(drafter.parameters()).device
    kwargs = dict(max_anchors=spec.max_anchors, gamma=spec.gamma, seed=spec.seed)
    trained = heldout_metrics(drafter, heldout_batches(setup, device), **kwargs)
    with initial_weights(setup, drafter):
        untrained = heldout_metrics(drafter, heldout_batches(setup, device), **kwargs)
    return {"heldout_samples": int(setup.eval_index.numel()), "heldout_trained": trained,
            "heldout_untrained": untrained}


@torch.no_grad()
def heldout_metrics(drafter, batches: Iterable[Batch], *, max_anchors: int = 512, gamma: float = 7.0,
                    seed: int = 0) -> dict:
    """The objective's loss, accuracy and per-position accuracy (and the blocks each position was scored
    on, ``per_position_count``) over held-out batches (with their ``target_hidden``); anchors are sampled from ``seed`` so repeated evaluations compare alike.
    """
    model = unwrap(drafter)
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    b = model.config.block_size
    sums = {"loss_sum": 0.0, "weight_sum": 0.0, "correct_sum": 0.0, "num_trained_tokens": 0.0,
            "num_blocks": 0.0, "accepted_sum": 0.0, "out_of_vocab": 0.0}
    pos_correct, pos_count = [0.0] * (b - 1), [0.0] * (b - 1)
    try:
        for batch in batches:
            _, m = dflash_loss(model, batch, max_anchors=max_anchors, gamma=gamma, generator=gen)
            for key in sums:
                sums[key] += m[key]
            pos_correct = [a + c for a, c in zip(pos_correct, m["per_position_correct"])]
            pos_count = [a + c for a, c in zip(pos_count, m["per_position_count"])]
    finally:
        model.train(was_training)
    tokens, blocks = sums["num_trained_tokens"], sums["num_blocks"]
    return {"loss": sums["loss_sum"] / sums["weight_sum"] if sums["weight_sum"] else 0.0,
            "accuracy": sums["correct_sum"] / tokens if tokens else 0.0,
            "per_position_accuracy": [c / n if n else 0.0 for c, n in zip(pos_correct, pos_count)],
            "per_position_count": pos_count,
            "mean_accepted": sums["accepted_sum"] / blocks + 1.0 if blocks else 0.0,
            "num_blocks": blocks, "num_trained_tokens": tokens,
            **({"out_of_vocab": sums["out_of_vocab"], "out_of_vocab_share": sums["out_of_vocab"] / tokens if tokens else 0.0}
               if model.config.pruned else {})}
