"""Helpers of the drafter model / objective / export / evaluation tests."""

from __future__ import annotations

import contextlib

import torch
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.families import build_drafter
from dfp_trainer.drafter.model import DFlashDrafter
from torch import nn

TOPICS = ["rivers", "prime numbers", "bread", "comets", "chess", "volcanoes", "owls", "bridges", "tea", "glaciers",
          "robots", "maps", "violins", "deserts", "coral", "clocks"]


@contextlib.contextmanager
def one_thread():
    """Run torch on one thread: tiny matrices gain nothing from more, and a busy machine makes them far slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def small_config(**overrides) -> DrafterConfig:
    """A small drafter over a synthetic 100-token vocabulary (mask token = 99)."""
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=512, vocab_size=100, num_target_layers=8, target_layer_ids=[1, 4],
                  mask_token_id=99, block_size=4)
    fields.update(overrides)
    return DrafterConfig(**fields)


def small_drafter(seed: int = 0, draft_ids: torch.Tensor | None = None, **overrides) -> DFlashDrafter:
    """A drafter of :func:`small_config`; with ``draft_ids``, over that pruned vocabulary (its own head)."""
    torch.manual_seed(seed)
    if draft_ids is not None:
        overrides["draft_vocab_size"] = draft_ids.numel()
    cfg = small_config(**overrides)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return build_drafter(cfg, embed, head, draft_ids)


def chat_prompts(start: int, count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Tell me fact {i} about {TOPICS[i % len(TOPICS)]}."}]
            for i in range(start, start + count)]


def block_hidden(drafter, ids: torch.Tensor, feats: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's states (S, N, B, H) of the blocks at ``anchors`` (S, N), each seeing the context before it."""
    from dfp_trainer.drafter.attention import training_masks

    cfg = drafter.config
    b, t = cfg.block_size, ids.shape[1]
    s, n = anchors.shape
    block = torch.full((s, n, b), cfg.mask_token_id)
    block[:, :, 0] = torch.gather(ids, 1, anchors)
    pos = anchors[:, :, None] + torch.arange(b)
    masks = training_masks(anchors, b, t, cfg.layer_types, cfg.sliding_window, "sdpa")
    return drafter(block.view(s, -1), pos.view(s, -1), feats, torch.arange(t), masks).view(s, n, b, -1)
