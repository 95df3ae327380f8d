"""Held-out objective metrics of a run: loss, accuracy and accuracy per block position on the
evaluation samples (kept out of training by :func:`~dfp_trainer.prepare.prepare`), for the trained
drafter and for the same drafter at its initial weights.

Hidden states come from the run's own hidden-state source, so the features are those training saw;
anchors are drawn from the run's seed, so both drafters are scored on the same blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import torch

from .data import Batch, collate
from .evaluate import heldout_metrics
from .stages import fetch_hidden


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
        batch.target_hidden = asyncio.run(fetch_hidden(setup.source, batch.sequences(), setup.layer_ids,
                                                       setup.max_tokens_per_request))
        yield batch.to(device)


def evaluate_heldout(setup, drafter) -> dict:
    """``{"heldout_trained": metrics, "heldout_untrained": metrics}`` (see
    :func:`~dfp_trainer.evaluate.heldout_metrics`); empty when there are no evaluation samples."""
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
