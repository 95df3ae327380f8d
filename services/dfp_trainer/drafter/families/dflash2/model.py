"""The DFlash2 drafter: the DFlash drafter (backbone, masks, block objective) plus grouped convolutions inside each
draft layer and a low-rank candidate selector, as vLLM serves it (``architectures: ["DFlash2DraftModel"]``, vLLM's
``DFlash2Qwen3ForCausalLM`` in ``qwen3_dflash2.py``, method ``dflash``, drafted by its V2 runner's
``DFlash2Speculator``).

* **Grouped convolutions** (per layer ``i``: ``layers.{i}.attention_conv`` and ``layers.{i}.mlp_conv``, each
  ``base_kernel`` (2, taps, H) and ``kernel_projection.weight`` (2 * taps * G, H), G = H / ``conv_group_size``):
  ``prepare(h)`` projects the layer's normed input h to per-token coefficients c (2, taps, G) and returns
  ``conv(h, c[0], base[0])``; ``finish(y, c[1])`` returns ``conv(y, c[1], base[1])``, where
  ``conv(x, d, b)[t] = sum_tap (b[tap] + d[tap, group of channel]) * x[t - tap]`` over the taps whose earlier
  token is in the same block (``t mod B >= tap``, B the block size: the rows of vLLM's query pass are blocks of
  ``1 + num_speculative_tokens`` tokens, so serving must use ``num_speculative_tokens = block_size - 1``). A layer
  is ``a = attn_conv.finish(attn(attn_conv.prepare(norm1(x)))); x += a; m = mlp_conv.finish(mlp(
  mlp_conv.prepare(norm2(x)))); x += m``; the context keys and values (``hidden_norm(fc(target features))``)
  are not convolved. Initialised as the identity (``base[:, 0] = 1``, the rest and the projection 0): an
  untrained DFlash2 drafter computes what the DFlash one does.
* **Candidate selector** (``candidate_selector.predecessor_codebook`` (V, r), ``.successor_codebook`` (V, r),
  ``.hidden_projection.weight`` (r, H), V the target's vocabulary): each drafted position's candidates are the
  ``selector_top_k`` largest logits of the LM head (vLLM's ``LogitsProcessor.get_top_k_tokens``, ids and
  values); candidate c after predecessor p scores ``logit(c) + sum_r P[p, r] * W h [r] * S[c, r]``. Drafting
  (:meth:`DFlash2Drafter.draft`, vLLM's ``_selector_walk_kernel`` at temperature 0) walks left to right: the
  first position's predecessor is the anchor (the block's first token, the last verified one), each later one's
  the candidate drafted just before it; each position drafts its best-scoring candidate.
* ``dflash_config`` carries ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``
  (vLLM reads them without defaults) and ``input_embedding_scale: 1.0``, ``output_multiplier: 1.0``,
  ``final_logit_softcapping: 0.0`` (vLLM's defaults, the only values drafted here).

No pruned vocabulary: vLLM's candidate ids are the LM head's rows, never mapped by ``d2t``.

Training (the rule is the project's; vLLM only serves): each trained position's loss is DFlash's cross-entropy of
the LM head's logits plus the cross-entropy of the selector's scores over its top-k candidates, the predecessor
being the sequence's true token before the position (teacher forcing: the anchor for the first), when the label is
among the candidates (else that part is 0: the selector cannot draft it). The argmax hits count the candidate the
walk drafts under teacher forcing, so the accuracies are those of the served drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import DrafterConfig
from ...model import DFlashDrafter
from ...modeling_dflash import DraftLayer


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """``conv(x, delta, base)`` over the last-but-one axis of ``x`` (..., Q, H), blocks of ``block_size`` side
    by side: ``delta`` (..., Q, taps, G) per-token coefficients of each group, ``base`` (taps, H)."""
    taps, groups = delta.shape[-2], delta.shape[-1]
    blocks = x.unflatten(-1, (groups, -1))  # (..., Q, G, H/G)
    base = base.view(taps, groups, -1)
    out = (base[0] + delta[..., 0, :, None]) * blocks
    position = torch.arange(x.shape[-2], device=x.device) % block_size
    for tap in range(1, min(taps, x.shape[-2])):
        shifted = F.pad(blocks[..., :-tap, :, :], (0, 0, 0, 0, tap, 0))  # the token ``tap`` before
        inside = (position >= tap).to(x.dtype)[:, None, None]
        out = out + (base[tap] + delta[..., tap, :, None]) * shifted * inside
    return out.flatten(-2)


class GroupedConv(nn.Module):
    """One of a DFlash2 layer's convolutions (vLLM's ``DFlashGroupedConv``): ``prepare`` before the sub-layer,
    ``finish`` after it, with coefficients of the sub-layer's input."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.taps, self.groups, self.block_size = taps, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0  # the identity
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coefficients = self.kernel_projection(h).unflatten(-1, (2, self.taps, self.groups))
        return grouped_conv(h, coefficients[..., 0, :, :], self.base_kernel[0], self.block_size), \
            coefficients[..., 1, :, :]

    def finish(self, y: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        return grouped_conv(y, coefficients, self.base_kernel[1], self.block_size)


class DFlash2Layer(DraftLayer):
    """A DFlash draft layer with a grouped convolution around its attention and one around its MLP."""

    def __init__(self, config, layer_idx: int, taps: int, group_size: int, block_size: int) -> None:
        super().__init__(config, layer_idx)
        self.attention_conv = GroupedConv(config.hidden_size, taps, group_size, block_size)
        self.mlp_conv = GroupedConv(config.hidden_size, taps, group_size, block_size)

    def forward(self, x, context, q_rope, k_rope, attention):
        h, coefficients = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context, q_rope, k_rope, attention), coefficients)
        h, coefficients = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), coefficients)


class CandidateSelector(nn.Module):
    """Scores of candidates after a predecessor token: ``sum_r P[pred, r] * (W h)[r] * S[cand, r]``."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.predecessor_codebook.shape[1] ** -0.25  # unit-variance codebook products; zero edges at first
        nn.init.normal_(self.predecessor_codebook, 0.0, std)
        nn.init.normal_(self.successor_codebook, 0.0, std)
        nn.init.zeros_(self.hidden_projection.weight)

    def forward(self, hidden: torch.Tensor, prev_ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """Edge scores (rows, k) of hidden states (rows, H), predecessors (rows,), candidates (rows, k)."""
        query = self.predecessor_codebook[prev_ids] * self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        return torch.einsum("nr,nkr->nk", query, self.successor_codebook[candidate_ids]).float()


class DFlash2Drafter(DFlashDrafter):
    """A DFlash drafter with grouped convolutions in its layers and a top-k candidate selector."""

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 draft_ids: torch.Tensor | None = None) -> None:
        if config.family != "dflash2":
            raise ValueError("a DFlash2 drafter needs conv_kernel_size, conv_group_size, selector_rank, selector_top_k")
        super().__init__(config, embed_tokens, lm_head, draft_ids)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank,
                                                    config.selector_top_k).to(embed_tokens.weight.device)

    def draft_layer(self, config, index: int) -> nn.Module:
        c = self.config
        return DFlash2Layer(config, index, c.conv_kernel_size, c.conv_group_size, c.block_size)

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        for module in self.modules():
            if isinstance(module, (GroupedConv, CandidateSelector)):
                module.reset_parameters()

    def candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k candidate ids (rows, k) and their logits (float32) of hidden states (rows, H)."""
        values, ids = torch.topk(self.logits(hidden).float(), self.config.selector_top_k, dim=-1)
        return ids, values

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor,
                  prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row DFlash cross-entropy plus the selector's cross-entropy over the top-k candidates after the true
        previous token (0 where the label is not a candidate), hits of the teacher-forced walk, no extra loss."""
        logits = self.logits(hidden).float()
        ce = F.cross_entropy(logits, labels, reduction="none")
        values, ids = torch.topk(logits, self.config.selector_top_k, dim=-1)
        scores = values + self.candidate_selector(hidden, prev_ids, ids.detach())
        is_label = ids == labels[:, None]
        found = is_label.any(-1)
        target = is_label.float().argmax(-1)
        ce = ce + F.cross_entropy(scores, target, reduction="none") * found
        correct = (found & (scores.argmax(-1) == target)).float().detach()
        return ce, correct, ce.new_zeros(())

    def draft(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Target ids drafted at positions with hidden states (n, H) after ``anchor``, left to right: each
        position's best-scoring top-k candidate after the token before it (the anchor, then the drafts)."""
        ids, values = self.candidates(hidden)
        prev, drafts = anchor.reshape(1).long(), []
        for i in range(ids.shape[0]):
            scores = values[i:i + 1] + self.candidate_selector(hidden[i:i + 1], prev, ids[i:i + 1])
            prev = ids[i:i + 1].gather(1, scores.argmax(-1, keepdim=True))[:, 0]
            drafts.append(prev)
        return torch.cat(drafts) if drafts else anchor.new_zeros(0).long()
