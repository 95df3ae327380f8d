"""The DSpark drafter: the DFlash drafter (backbone, masks, block objective) plus a sequential Markov head and an
optional confidence head, as vLLM's Qwen3 DSpark drafter (``Qwen3DSparkModel``, method ``dspark``) serves them.

* **Markov head** (``markov_head.markov_w1.weight`` (V, r), ``markov_head.markov_w2.weight`` (V_d, r)): the
  previous token's rank-r embedding (a target id, ``markov_w1`` has the target's V rows) projected to a bias
  over the draft vocabulary (V_d rows: the pruned vocabulary's with ``draft_vocab_size``, else V) added to
  the position's logits. Drafting (:meth:`DSparkDrafter.draft`) runs it left to right as vLLM does: the
  first draft position's bias comes from the anchor (the last verified token), each later one's from the
  token drafted just before it, mapped to its target id. Training runs it under teacher forcing: the bias of
  block position k comes from the sequence's true token at ``a + k - 1``, so the block cross-entropy of
  :func:`~dfp_trainer.drafter.objective.dflash_loss` is over the logits the drafter serves with.
* **Confidence head** (``confidence_head.proj.weight`` (1, H), ``confidence_head.proj.bias`` (1,)): a logit
  per draft position, of the position's final hidden state only (``confidence_head_with_markov: false``),
  whose sigmoid is the probability that the position's draft is right. Trained by binary cross-entropy
  against whether the teacher-forced draft was the label (whenever the earlier drafts were accepted the
  served draft is that one); the hidden state is detached there, so the head reads the drafter without
  steering it. vLLM uses it only with ``enable_adaptive_verification`` (to size the verification budget);
  it never changes the drafted tokens.

vLLM loads these names under ``model.`` beside the DFlash backbone's; its folder's ``__init__`` declares the config fields.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import DrafterConfig
from ...model import DFlashDrafter


class MarkovHead(nn.Module):
    """Rank-r transition bias: target id of the previous token -> a bias over the draft vocabulary."""

    def __init__(self, vocab_size: int, draft_rows: int, rank: int, std: float = 0.02) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_rows, bias=False)
        nn.init.normal_(self.markov_w1.weight, 0.0, std)
        nn.init.normal_(self.markov_w2.weight, 0.0, std)

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """(...,) target ids -> (..., draft rows) bias."""
        return self.markov_w2(self.markov_w1(prev_ids))


class ConfidenceHead(nn.Module):
    """One logit per position: the probability (after a sigmoid) that its draft is right."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1, bias=True)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """A DFlash drafter with a Markov head and, if its config says so, a confidence head."""

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 draft_ids: torch.Tensor | None = None) -> None:
        if config.markov_rank is None:
            raise ValueError("a DSpark drafter needs markov_rank")
        super().__init__(config, embed_tokens, lm_head, draft_ids)
        device = embed_tokens.weight.device
        self.markov_head = MarkovHead(config.vocab_size, config.draft_vocab_size or config.vocab_size,
                                      config.markov_rank).to(device)
        self.confidence_head = ConfidenceHead(config.hidden_size).to(device) if config.confidence_head else None

    def serving_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (float32) of hidden states (..., H) given each one's previous token (...,)."""
        return self.logits(hidden).float().add_(self.markov_head(prev_ids))  # in place: one vocabulary-wide buffer

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor,
                  prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row cross-entropy of the teacher-forced serving logits, argmax hits, and the confidence head's
        summed binary cross-entropy against those hits (0 without one)."""
        logits = self.serving_logits(hidden, prev_ids)
        ce = F.cross_entropy(logits, labels, reduction="none")
        correct = (logits.argmax(-1) == labels).float().detach()
        if self.confidence_head is None:
            return ce, correct, ce.new_zeros(())
        bce = F.binary_cross_entropy_with_logits(self.confidence_head(hidden.detach()).float(), correct,
                                                 reduction="sum")
        return ce, correct, bce

    def draft(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Target ids drafted at positions with hidden states (n, H) after ``anchor`` (a target id), left to right:
        each position's logits biased by the Markov head of the token before it (the anchor, then the drafts)."""
        base = self.logits(hidden).float()
        prev, drafts = anchor.reshape(1).long(), []
        for i in range(base.shape[0]):
            token = self.to_target((base[i] + self.markov_head(prev)[0].float()).argmax(-1, keepdim=True))
            drafts.append(token)
            prev = token
        return torch.cat(drafts) if drafts else anchor.new_zeros(0).long()

    def confidence(self, hidden: torch.Tensor) -> torch.Tensor:
        """Per-position probability that the draft is right (n,), from the confidence head."""
        if self.confidence_head is None:
            raise ValueError("this DSpark drafter has no confidence head")
        return torch.sigmoid(self.confidence_head(hidden).float())

