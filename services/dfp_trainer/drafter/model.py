"""The DFlash drafter: Qwen3 draft layers with KV injection of projected target features.

The norms, MLP and rotary embedding are transformers' Qwen3 modules, driven by the transformers
config the exported ``config.json`` describes; only the DFlash attention (and its masks, in
:mod:`dfp_trainer.drafter.attention`) is ours. The drafter owns no embedding and no LM head: it borrows the
target's (frozen, not registered as sub-modules, so neither ``parameters()`` nor ``state_dict()``
hold them). Module attribute names follow the public reference module tree, so ``state_dict()`` is
already the export format (``layers.{i}.self_attn.q_proj.weight`` ... ``fc.weight``,
``hidden_norm.weight``). Its configuration is :class:`~dfp_trainer.drafter.config.DrafterConfig`.

With a pruned vocabulary (``draft_vocab_size``, :mod:`dfp_trainer.drafter.vocab`) the drafter owns an LM head
of the target's rows of its draft vocabulary, frozen as the target's head is (the draft layers learn to read
the target's head; the pruned one is that head restricted), and the ``d2t`` buffer; both are in
``state_dict()`` as ``lm_head.weight`` and ``d2t``, the names vLLM loads.

Shapes: S = sequences, Q = block tokens per sequence (all blocks of a sequence side by side),
C = context positions, H = hidden size, K = number of target layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from .attention import AttentionMasks, attention_fn
from .config import DrafterConfig
from .head_loss import head_cross_entropy
from .modeling_dflash import DraftLayer, add_draft_head, add_draft_modules, draft_hidden, draft_to_target
from .vocab import d2t_of, target_to_draft


class DFlashDrafter(nn.Module):
    """DFlash draft model over a frozen target embedding and LM head."""

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                 draft_ids: torch.Tensor | None = None) -> None:
        """``draft_ids``: with ``config.draft_vocab_size``, the target ids (ascending) of the draft vocabulary's
        tokens; left unset, placeholders that a loaded ``state_dict`` replaces (:func:`~.load.load_exported`)."""
        super().__init__()
        config.validate()
        rows, width = embed_tokens.weight.shape
        if width != config.hidden_size or lm_head.in_features != config.hidden_size:
            raise ValueError(f"target embedding/LM head width ({width}, {lm_head.in_features}) differs from the "
                             f"drafter's hidden_size {config.hidden_size}")
        if config.mask_token_id >= rows:
            raise ValueError(f"mask_token_id {config.mask_token_id} is outside the target embedding ({rows} rows)")
        if config.vocab_size > rows:  # a stored config sizes the draft head and DSpark's tables by it
            raise ValueError(f"vocab_size {config.vocab_size} is more than the target embedding's {rows} rows")
        self.config = config
        add_draft_modules(self, config.qwen3_config(), config.num_context_features, self.draft_layer)
        embed_tokens.requires_grad_(False)
        lm_head.requires_grad_(False)
        self._target = (embed_tokens, lm_head)  # a tuple: frozen and not registered
        self.reset_parameters()
        self._add_pruned_head(draft_ids)

    def draft_layer(self, config, index: int) -> nn.Module:
        """Draft layer ``index`` of the family (DFlash: :class:`~.modeling_dflash.DraftLayer`)."""
        return DraftLayer(config, index)

    def _add_pruned_head(self, draft_ids: torch.Tensor | None) -> None:
        holder = nn.Module()
        if not add_draft_head(holder, self.config.qwen3_config()):
            if draft_ids is not None:
                raise ValueError("draft_ids given for a drafter without draft_vocab_size")
            return
        size = self.config.draft_vocab_size
        ids = torch.arange(size) if draft_ids is None else draft_ids.to("cpu", torch.long)
        if ids.shape != (size,) or bool((ids[1:] <= ids[:-1]).any()) or not 0 <= int(ids[0]) <= int(ids[-1]) < \
                self.config.vocab_size:
            raise ValueError(f"draft_ids must be {size} ascending target ids below {self.config.vocab_size}")
        target = self._target[1].weight
        head = holder.lm_head.to(target.device, target.dtype).requires_grad_(False)
        head.weight.copy_(target.detach()[ids.to(target.device)])
        self._modules["lm_head"] = head  # registered under the export's name; the lm_head property reads it
        self.register_buffer("d2t", d2t_of(ids).to(target.device))

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target[0]

    @property
    def lm_head(self) -> nn.Linear:
        """The LM head the drafter drafts with: its own over a pruned vocabulary, else the target's."""
        own = self._modules.get("lm_head")
        return self._target[1] if own is None else own

    @property
    def target_lm_head(self) -> nn.Linear:
        return self._target[1]

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)
        for layer in self.layers:  # scaled residual projections, as GPT-2 / nanoGPT do
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                nn.init.normal_(proj.weight, 0.0, std / math.sqrt(2 * len(self.layers)))

    @torch.no_grad()
    def scale_norm_to_unit_logits(self) -> float:
        """Set the final norm's weights to ``1 / rms(row norms)`` of the drafting LM head; returns that scale.

        The final norm leaves a unit-RMS state, so at a random start a logit's standard deviation is the norm's
        weight times its head row's norm, and a state still close to its input token's embedding (the block's
        anchor or mask token, the draft layers' writes being small) puts that token's logit about sqrt(hidden)
        standard deviations above the rest under a tied head: a near one-hot first softmax on the wrong token,
        a scale only the norm's weights can undo, and AdamW moves them about one learning rate a step."""
        rows = self.lm_head.weight.detach()
        squares = sum(float(torch.linalg.vector_norm(chunk, dim=1, dtype=torch.float32).pow(2).sum())
                      for chunk in rows.split(16_384))  # a chunk at a time: no float32 copy of a large head
        scale = (squares / rows.shape[0]) ** -0.5 if squares > 0 else math.inf
        if not math.isfinite(scale):
            raise ValueError(f"the LM head's rows have no usable norm (mean square {squares / rows.shape[0]}): "
                             "unit_logits cannot scale the final norm by it")
        self.norm.weight.fill_(scale)
        return scale

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def _apply(self, fn, recurse=True):
        """``.to(device)`` / ``.cuda()`` also move the borrowed target parts; their dtype is left alone."""
        super()._apply(fn, recurse)

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(fn(t.reshape(-1)[:1]).device)

        for module in self._target:
            module._apply(move, recurse)
        return self

    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(block_ids, self.embed_tokens.weight)

    def forward(self, block_ids: torch.Tensor, block_positions: torch.Tensor, target_hidden: torch.Tensor,
                context_positions: torch.Tensor, masks: AttentionMasks | None = None) -> torch.Tensor:
        """Draft hidden states (after the final norm) for the block tokens.

        block_ids (S, Q) long: the blocks' tokens (anchor then mask tokens), blocks side by side.
        block_positions (S, Q): their position ids (anchor + k).
        target_hidden (S, C, K*H): concatenated target layer outputs of the context positions.
        context_positions (S, C) or (C,): position ids of the context.
        masks: which keys each query sees (see :mod:`dfp_trainer.drafter.attention`); None = everything.
        Returns (S, Q, H).
        """
        s = block_ids.shape[0]
        if target_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(f"target_hidden has width {target_hidden.shape[-1]}; expected "
                             f"{self.fc.in_features} = {self.config.num_context_features} layers x "
                             f"{self.config.hidden_size}")
        if context_positions.dim() == 1:
            context_positions = context_positions.expand(s, -1)
        return draft_hidden(self, self.embed_block(block_ids), target_hidden, context_positions, block_positions,
                            attention_fn(masks))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the drafter's vocabulary: draft ids with a pruned one (map them by :meth:`to_target`)."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor,
                  prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row cross-entropy of rows (rows, H) against draft-id labels, argmax hits, and the family's extra
        loss (none here: ``prev_ids``, each row's previous true token, is for a DSpark drafter's Markov head)."""
        ce, correct = head_cross_entropy(hidden, labels, self.lm_head)
        return ce, correct, ce.new_zeros(())

    def draft(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Target ids drafted at positions with hidden states (n, H) after ``anchor``: each one's argmax over the
        drafter's vocabulary, mapped to target ids (a token outside a pruned one is never drafted)."""
        return self.to_target(self.logits(hidden).argmax(-1))

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of ids of :meth:`logits` (draft ids under a pruned vocabulary; else themselves)."""
        return draft_to_target(self.d2t, ids) if self.config.pruned else ids

    def label_map(self) -> torch.Tensor | None:
        """(vocab_size,) draft id of each target token (-1 outside) under a pruned vocabulary; else None."""
        return target_to_draft(self.d2t, self.config.vocab_size) if self.config.pruned else None
