"""The DFlash draft model's layers and visibility rule, self-contained: torch and transformers only.

The export copies this file beside the weights as ``modeling_dflash.py`` and names it in
``config.json``'s ``auto_map``, so ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` builds
:class:`DFlashDraftModel` from the very code the trainer runs: the trainer's drafter
(``dfp_trainer.drafter.model``) is made of these layers and its masks (``dfp_trainer.drafter.attention``) apply
:func:`visible`.

Keys of a draft layer are ``[context positions ; block tokens]``; a query of the block anchored at
position ``a`` sees, by layer type (what vLLM's and SGLang's DFlash models compute):

- ``full_attention``: every context key at a position ``< a`` (the anchor's own hidden state is not
  known when drafting) and every token of its own block, later ones included (not causal). vLLM:
  non-causal (``is_causal: false``, or no causality field and the layer is not sliding); SGLang:
  ``ENCODER_ONLY`` attention.
- ``sliding_attention`` with window ``w``: the same keys, restricted to ``0 <= pos(query) - pos(key) < w``:
  causal inside the block, and context within the window. vLLM: causal when neither ``is_causal`` nor
  ``dflash_config.causal`` is set and ``layer_types[i]`` is sliding, ``per_layer_sliding_window = w``;
  SGLang: ``DECODER`` attention with ``window_left = w - 1``.

A drafter with a pruned vocabulary (``draft_vocab_size`` below ``vocab_size``) carries its own ``lm_head``
(``draft_vocab_size`` rows) and ``d2t`` (int64): draft id ``i`` is the target's token ``i + d2t[i]``, as
vLLM reads them; :meth:`DFlashDraftModel.target_logits` and :meth:`DFlashDraftModel.draft_tokens` apply it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def visible(window: int | None, q_anchor, q_pos, q_block, k_pos, k_block, k_is_context):
    """Whether each query may attend each key (broadcasting tensors); ``window`` None: a full layer."""
    vis = torch.where(k_is_context, k_pos < q_anchor, k_block == q_block)
    if window:
        offset = q_pos - k_pos
        vis = vis & (offset >= 0) & (offset < window)
    return vis


def layer_window(config, layer_type: str) -> int | None:
    """The window of a layer of ``layer_type`` under ``config`` (None for full attention)."""
    return int(config.sliding_window) if layer_type == SLIDING_ATTENTION else None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + rotate_half(x) * sin[:, None]  # cos/sin (S, L, D) broadcast over heads


def sdpa_attention(masks: dict[str, torch.Tensor] | None):
    """An attention callable for :class:`DraftAttention`: SDPA with each layer type's boolean mask."""

    def attend(q, k, v, layer_type):
        mask = masks.get(layer_type) if masks else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


class DraftAttention(Qwen3Attention):
    """Qwen3's attention projections; queries from the block tokens, keys/values from [context ; block tokens]."""

    def forward(self, x, context, q_rope, k_rope, attention):
        s, q_len, _ = x.shape
        kv_in = torch.cat([context, x], dim=1)  # (S, C+Q, H)
        q = self.q_norm(self.q_proj(x).view(s, q_len, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(s, kv_in.shape[1], -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(s, kv_in.shape[1], -1, self.head_dim).transpose(1, 2)
        q = _rotate(q, *q_rope)  # (S, heads, Q, D)
        k = _rotate(k, *k_rope)  # (S, kv_heads, C+Q, D)
        out = attention(q, k, v, self.layer_type)  # (S, heads, Q, D)
        return self.o_proj(out.transpose(1, 2).reshape(s, q_len, -1))


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, context, q_rope, k_rope, attention):
        x = x + self.self_attn(self.input_layernorm(x), context, q_rope, k_rope, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


def add_draft_modules(model: nn.Module, config: Qwen3Config, num_context_features: int, layer=DraftLayer) -> None:
    """The trained part of a drafter, as attributes of ``model`` (the export's tensor names): draft
    ``layers`` (``layer(config, i)``: a :class:`DraftLayer` or a family's), final ``norm``, context projection
    ``fc`` and its ``hidden_norm``; and the rotary table."""
    model.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
    model.norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
    model.fc = nn.Linear(num_context_features * config.hidden_size, config.hidden_size, bias=False)
    model.hidden_norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
    model.rotary = Qwen3RotaryEmbedding(config)


def draft_to_target(d2t: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """The target's token ids of ``draft_ids`` under a pruned vocabulary's ``d2t``: ``draft id + d2t[draft id]``."""
    return draft_ids + d2t[draft_ids]


def add_draft_head(model: nn.Module, config) -> bool:
    """A pruned vocabulary's own ``lm_head`` (``draft_vocab_size`` rows, set from the target's rows of its
    tokens) and ``d2t``, as attributes of ``model``, when ``config.draft_vocab_size`` is below
    ``config.vocab_size``; returns whether it added them (False: the target's LM head drafts)."""
    size = getattr(config, "draft_vocab_size", None)
    if size is None or int(size) == int(config.vocab_size):
        return False
    model.lm_head = nn.Linear(config.hidden_size, int(size), bias=False)
    model.register_buffer("d2t", torch.zeros(int(size), dtype=torch.long))
    return True


def draft_hidden(model: nn.Module, x, target_hidden, context_positions, block_positions, attention):
    """Draft hidden states (S, Q, H) of block embeddings ``x`` (S, Q, H) after the context features
    ``target_hidden`` (S, C, K*H), through the modules :func:`add_draft_modules` gave ``model``;
    positions (S, C) and (S, Q); ``attention(q, k, v, layer_type)`` applies each layer type's mask."""
    context = model.hidden_norm(model.fc(target_hidden.to(model.fc.weight.dtype)))  # (S, C, H)
    x = x.to(model.fc.weight.dtype)
    cos, sin = model.rotary(x, torch.cat([context_positions, block_positions], dim=1))  # (S, C+Q, D)
    q_len = block_positions.shape[1]
    k_rope, q_rope = (cos, sin), (cos[:, -q_len:], sin[:, -q_len:])
    for layer in model.layers:
        x = layer(x, context, q_rope, k_rope, attention)
    return model.norm(x)


def one_block_masks(config, context_positions, block_positions) -> dict[str, torch.Tensor]:
    """Boolean SDPA masks (S, 1, Q, C+Q) per layer type for one block after its context (decoding)."""
    s, q_len = block_positions.shape
    q_anchor = block_positions[:, :1].expand(s, q_len)[:, :, None]
    k_pos = torch.cat([context_positions, block_positions], dim=1)[:, None, :]
    k_is_context = (torch.arange(k_pos.shape[-1], device=k_pos.device) < context_positions.shape[1])[None, None]
    zeros_q, zeros_k = torch.zeros_like(block_positions)[:, :, None], torch.zeros_like(k_pos)
    k_block = torch.where(k_is_context, -1, zeros_k)
    masks = {}
    for kind in set(config.layer_types):
        masks[kind] = visible(layer_window(config, kind), q_anchor, block_positions[:, :, None], zeros_q,
                              k_pos, k_block, k_is_context)[:, None]
    return masks


class DFlashDraftModel(PreTrainedModel):
    """A DFlash drafter as transformers loads it (no embedding, no LM head: those are the target's).

    ``forward(noise_embedding, target_hidden, position_ids)``: ``noise_embedding`` (S, Q, H) is the
    target's embedding of one block (anchor token, then mask tokens); ``target_hidden`` (S, C, K*H)
    the target's layer outputs ``dflash_config.target_layer_ids`` of the context, concatenated;
    ``position_ids`` (S, C+Q) the context's positions then the block's. Returns the draft hidden
    states (S, Q, H); :meth:`target_logits` turns them into logits over the target's vocabulary (the
    target's LM head, or the drafter's own pruned one scattered to its target ids), :meth:`draft_tokens`
    into the drafted tokens.
    """

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DraftLayer"]
    _supports_sdpa = True

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = config.dflash_config
        self.block_size = int(dflash.get("block_size", getattr(config, "block_size", 16)))
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        add_draft_modules(self, config, len(self.target_layer_ids))
        self.pruned = add_draft_head(self, config)
        self.post_init()

    def target_logits(self, hidden: torch.Tensor, target_lm_head: nn.Module | None = None) -> torch.Tensor:
        """Logits (..., vocab_size) over the target's vocabulary: with a pruned vocabulary the own head's,
        at ``draft id + d2t`` and -inf at every other token (what vLLM computes); else ``target_lm_head``'s."""
        if not self.pruned:
            if target_lm_head is None:
                raise ValueError("this drafter drafts with the target's LM head: pass it as target_lm_head")
            return target_lm_head(hidden)
        draft = self.lm_head(hidden)
        full = draft.new_full((*draft.shape[:-1], int(self.config.vocab_size)), float("-inf"))
        full[..., draft_to_target(self.d2t, torch.arange(draft.shape[-1], device=draft.device))] = draft
        return full

    def draft_tokens(self, hidden: torch.Tensor, target_lm_head: nn.Module | None = None) -> torch.Tensor:
        """The drafted target token ids (...,): the argmax of the drafter's logits, mapped by ``d2t``."""
        if not self.pruned:
            return self.target_logits(hidden, target_lm_head).argmax(-1)
        return draft_to_target(self.d2t, self.lm_head(hidden).argmax(-1))

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        q_len = noise_embedding.shape[1]
        if position_ids.dim() == 1:
            position_ids = position_ids.expand(noise_embedding.shape[0], -1)
        context_positions, block_positions = position_ids[:, :-q_len], position_ids[:, -q_len:]
        masks = one_block_masks(self.config, context_positions, block_positions)
        return draft_hidden(self, noise_embedding, target_hidden, context_positions, block_positions, sdpa_attention(masks))
