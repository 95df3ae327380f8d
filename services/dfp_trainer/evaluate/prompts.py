"""The prompts a run evaluates its drafter on: the held-out samples' own prompt tokens (chat template
and thinking mode exactly as the dataset was tokenized, which is how the drafter will serve)."""

from __future__ import annotations

import torch


def eval_prompts(setup) -> list[torch.Tensor]:
    """Prompts of the held-out samples: each sample's tokens before its first trained token."""
    ds = setup.dataset
    prompts = []
    for i in setup.eval_index.tolist():
        a, b = int(ds.offsets[i]), int(ds.offsets[i + 1])
        mask = ds.loss_mask[a:b]
        first = int(torch.nonzero(mask).flatten()[0]) if int(mask.sum()) else b - a
        if first > 0:
            prompts.append(ds.input_ids[a:a + first].to(torch.int64))
    return prompts
