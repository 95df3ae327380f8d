"""The pruned draft vocabulary's ids: which target tokens a drafter can draft, and the mapping between its ids.

A drafter with ``draft_vocab_size`` V_d below the target's V rows drafts over V_d draft ids through its own
LM head (the target's rows of those tokens, :class:`~.model.DFlashDrafter`). The mapping's rules, in one place
(which tokens a run chooses from its training data: :mod:`dfp_trainer.components.data.draft_vocab`):

* **Ids**: draft ids follow ascending target ids, so the mapping is monotone: the first maximum of the draft
  logits is the first maximum of vLLM's target-vocabulary logits (the draft logits scattered to their target
  ids, -inf elsewhere), ties included.
* **Export** (:func:`d2t_of`): ``d2t`` int64 (V_d,), draft id ``i`` is target id ``i + d2t[i]`` (what vLLM's
  DFlash model loads as ``draft_id_to_target_id``; it skips ``t2d``, which is not written);
  :func:`~.modeling_dflash.draft_to_target` applies it, in the shipped modeling file and here alike.
* **Loss** (:func:`target_to_draft`): a label outside the vocabulary has no draft id, so no draft can be right
  there: the position is left out of the loss (nothing to learn from it), but still scored, as wrong, in
  the accuracies (so the τ they predict counts the misses a served drafter makes) and counted as
  ``out_of_vocab`` in the metrics.
"""

from __future__ import annotations

import torch

from .modeling_dflash import draft_to_target


def d2t_of(target_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's ``d2t`` (V_d,) int64 of ascending target ids: draft id ``i`` -> offset ``target_ids[i] - i``."""
    return target_ids.long() - torch.arange(target_ids.numel(), device=target_ids.device)


def target_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft id (V_d,) int64, from ``d2t``."""
    return draft_to_target(d2t, torch.arange(d2t.numel(), device=d2t.device))


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) int64: the draft id of each target id, -1 for tokens outside the draft vocabulary."""
    table = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    table[target_ids_of(d2t)] = torch.arange(d2t.numel(), device=d2t.device)
    return table
