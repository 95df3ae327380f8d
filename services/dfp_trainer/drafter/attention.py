"""The drafter's attention masks for training (many blocks per sequence) and decoding (one block after
the whole context), and the attention call (SDPA everywhere, flex on CUDA).

Which key a query sees is one rule per layer type, :func:`dfp_trainer.drafter.modeling_dflash.visible` (full
layers: context before the anchor and the whole own block; sliding layers: the same keys, causal and
within the window, as vLLM and SGLang compute them). It is applied here to per-query and per-key
descriptors and materialised as a boolean SDPA mask, or as a flex-attention ``BlockMask`` on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

import torch
import torch.nn.functional as F
from dfp_shared.specs.train import LayerType

from .modeling_dflash import visible

FULL, SLIDING = get_args(LayerType)


@dataclass
class AttentionMasks:
    """Per layer type: a boolean mask (S, 1, Q, C+Q) (True = may attend) or a flex BlockMask."""

    masks: dict[str, object] = field(default_factory=dict)
    backend: str = "sdpa"  # "sdpa" | "flex"

    def for_layer(self, layer_type: str):
        return self.masks.get(layer_type)


@dataclass
class _Descriptors:
    q_anchor: torch.Tensor  # (S, Q) anchor position of the query's block
    q_pos: torch.Tensor  # (S, Q) position id of the query
    q_block: torch.Tensor  # (S, Q) block index of the query
    k_pos: torch.Tensor  # (S, C+Q) position id of the key
    k_block: torch.Tensor  # (S, C+Q) block index of the key; -1 for context keys
    context_len: int


def _bool_mask(d: _Descriptors, window: int | None) -> torch.Tensor:
    kv = d.k_pos.shape[1]
    is_ctx = (torch.arange(kv, device=d.k_pos.device) < d.context_len)[None, None, :]
    vis = visible(window, d.q_anchor[:, :, None], d.q_pos[:, :, None], d.q_block[:, :, None],
                   d.k_pos[:, None, :], d.k_block[:, None, :], is_ctx)
    return vis[:, None]  # (S, 1, Q, C+Q)


def _flex_mask(d: _Descriptors, window: int | None):
    from torch.nn.attention.flex_attention import create_block_mask

    c = d.context_len

    def mask_mod(b, h, q, kv):
        return visible(window, d.q_anchor[b, q], d.q_pos[b, q], d.q_block[b, q], d.k_pos[b, kv],
                        d.k_block[b, kv], kv < c)

    s, q_len = d.q_pos.shape
    return create_block_mask(mask_mod, s, None, q_len, d.k_pos.shape[1], device=d.q_pos.device)


def flex_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _build(d: _Descriptors, layer_types: list[str], sliding_window: int | None, backend: str) -> AttentionMasks:
    if backend == "auto":
        backend = "flex" if flex_available(d.q_pos.device) else "sdpa"
    if backend not in ("sdpa", "flex"):
        raise ValueError(f"unknown attention backend {backend!r}; expected auto, sdpa or flex")
    make = _flex_mask if backend == "flex" else _bool_mask
    masks = {}
    for kind in sorted(set(layer_types)):
        masks[kind] = make(d, sliding_window if kind == SLIDING else None)
    return AttentionMasks(masks, backend)


def training_masks(anchors: torch.Tensor, block_size: int, context_len: int, layer_types: list[str],
                   sliding_window: int | None = None, backend: str = "auto") -> AttentionMasks:
    """Masks for N blocks per sequence laid side by side (Q = N * block_size) after C context keys.

    anchors (S, N) long: anchor position of each block (padding blocks may use any position: they
    still see their own block, so no attention row is empty).
    """
    s, n = anchors.shape
    dev = anchors.device
    offs = torch.arange(block_size, device=dev)
    q_anchor = anchors[:, :, None].expand(s, n, block_size).reshape(s, n * block_size)
    q_pos = (anchors[:, :, None] + offs).reshape(s, n * block_size)
    q_block = torch.arange(n, device=dev).repeat_interleave(block_size).expand(s, -1)
    ctx_pos = torch.arange(context_len, device=dev).expand(s, -1)
    d = _Descriptors(q_anchor=q_anchor, q_pos=q_pos, q_block=q_block,
                     k_pos=torch.cat([ctx_pos, q_pos], dim=1),
                     k_block=torch.cat([torch.full_like(ctx_pos, -1), q_block], dim=1), context_len=context_len)
    return _build(d, layer_types, sliding_window, backend)


def decode_masks(anchor: int, context_positions: torch.Tensor, block_len: int, layer_types: list[str],
                 sliding_window: int | None = None) -> AttentionMasks | None:
    """Masks for one block at ``anchor`` after its context (decoding); None when nothing is hidden."""
    dev = context_positions.device
    if SLIDING not in layer_types and bool((context_positions < anchor).all()):
        return None
    q_pos = (anchor + torch.arange(block_len, device=dev))[None]
    zeros = torch.zeros_like(q_pos)
    ctx = context_positions[None].long()
    d = _Descriptors(q_anchor=torch.full_like(q_pos, anchor), q_pos=q_pos, q_block=zeros,
                     k_pos=torch.cat([ctx, q_pos], dim=1), k_block=torch.cat([torch.full_like(ctx, -1), zeros], dim=1),
                     context_len=ctx.shape[1])
    return _build(d, layer_types, sliding_window, "sdpa")


def batch_decode_masks(anchors: torch.Tensor, context_positions: torch.Tensor, block_lens: torch.Tensor, block_len: int,
                       layer_types: list[str], sliding_window: int | None = None) -> AttentionMasks:
    """Masks for one block per row (decoding a batch): row i's block anchored at ``anchors[i]`` holds
    ``block_lens[i]`` real tokens of ``block_len``; its padding tokens form a block of their own, and context
    padding must carry a position after the block (hidden from every query by the visibility rule)."""
    offs = torch.arange(block_len, device=anchors.device)
    q_pos = anchors[:, None] + offs  # (S, Q)
    q_block = (offs[None] >= block_lens[:, None]).long()  # 0: the real block; 1: its padding
    ctx = context_positions.long()
    d = _Descriptors(q_anchor=anchors[:, None].expand_as(q_pos), q_pos=q_pos, q_block=q_block,
                     k_pos=torch.cat([ctx, q_pos], dim=1), k_block=torch.cat([torch.full_like(ctx, -1), q_block], dim=1),
                     context_len=ctx.shape[1])
    return _build(d, layer_types, sliding_window, "sdpa")


_compiled_flex = None


def flex_attend(q, k, v, block_mask, compiled: bool | None = None):
    """Flex attention over a ``BlockMask``: compiled (Inductor: Triton kernels on CUDA, C++ on the CPU)
    by default on CUDA, eager elsewhere (the reference tests check against SDPA); ``compiled`` forces
    either, so the compiled path can be checked where no GPU is."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if compiled if compiled is not None else q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        fn = _compiled_flex
    else:
        fn = flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def attention_fn(masks: AttentionMasks | None):
    """The ``attention(q, k, v, layer_type)`` callable the draft layers call, over these masks."""
    return lambda q, k, v, layer_type: attend(q, k, v, masks, layer_type)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: AttentionMasks | None,
           layer_type: str) -> torch.Tensor:
    """Attention of q (S, heads, Q, D) over k, v (S, kv_heads, C+Q, D) -> (S, heads, Q, D)."""
    gqa = q.shape[1] != k.shape[1]
    mask = masks.for_layer(layer_type) if masks is not None else None
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if masks.backend == "flex":
        return flex_attend(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
