"""The drafter model: config rules, module tree, frozen target parts, and what a block may see."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dfp_trainer.drafter.attention import decode_masks, training_masks
from dfp_trainer.drafter.config import DrafterConfig

from tests.trainer.drafter_support import small_config, small_drafter

QWEN3_LIKE = {"num_hidden_layers": 8, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "vocab_size": 100,
              "max_position_embeddings": 512, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}


def test_for_target_defaults_and_multimodal_config():
    one = DrafterConfig.for_target(QWEN3_LIKE, num_layers=1, mask_token_id=99)
    assert one.target_layer_ids == [4] and one.rope_theta == 5e5 and one.block_size == 16
    three = DrafterConfig.for_target({"text_config": QWEN3_LIKE}, num_layers=3, mask_token_id=99)
    assert three.target_layer_ids == [1, 3, 5]  # spread over 1..L-3
    assert three.layer_types == ["full_attention"] * 3
    assert three.head_dim == 8 and three.num_key_value_heads == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"num_layers": 2}, "no mask token"),
    ({"num_layers": 4, "mask_token_id": 99, "target": {**QWEN3_LIKE, "num_hidden_layers": 4}}, "too shallow"),
    ({"num_layers": 1, "mask_token_id": 99, "target_layer_ids": [2, 8]}, r"target_layer_ids \[8\] do not exist"),
    ({"num_layers": 1, "mask_token_id": 100}, "not a token of the target's vocabulary"),
    ({"num_layers": 2, "mask_token_id": 99, "layer_types": ["full_attention", "sliding_attention"]},
     "positive sliding_window"),
    ({"num_layers": 1, "mask_token_id": 99, "layer_types": ["linear_attention"]}, "unknown layer_types"),
    ({"num_layers": 1, "mask_token_id": 99, "block_size": 1}, "block_size"),
])
def test_for_target_bad_input(kwargs, message):
    target = kwargs.pop("target", QWEN3_LIKE)
    with pytest.raises(ValueError, match=message):
        DrafterConfig.for_target(target, **kwargs)


def test_module_tree_matches_reference_names_and_target_parts_are_frozen():
    drafter = small_drafter()
    names = set(drafter.state_dict())
    expected = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.self_attn.{n}.weight" for n in ("q_norm", "k_norm")}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    assert names == expected
    assert drafter.fc.weight.shape == (32, 2 * 32)
    params = {id(p) for p in drafter.parameters()}
    assert id(drafter.embed_tokens.weight) not in params and id(drafter.lm_head.weight) not in params
    assert not drafter.embed_tokens.weight.requires_grad and not drafter.lm_head.weight.requires_grad
    assert all(p.requires_grad for p in drafter.trainable_parameters())
    drafter.to(torch.bfloat16)  # a dtype change leaves the borrowed target parts alone
    assert drafter.fc.weight.dtype == torch.bfloat16 and drafter.lm_head.weight.dtype == torch.float32


def test_drafter_rejects_mismatched_target_parts():
    from dfp_trainer.drafter.model import DFlashDrafter
    from torch import nn

    cfg = small_config()
    with pytest.raises(ValueError, match="hidden_size"):
        DFlashDrafter(cfg, nn.Embedding(100, 16), nn.Linear(32, 100))
    with pytest.raises(ValueError, match="outside the target embedding"):
        DFlashDrafter(cfg, nn.Embedding(50, 32), nn.Linear(32, 50))
    # a stored config claiming more rows than the target has would size the draft head by its claim
    with pytest.raises(ValueError, match=r"vocab_size 1099511627776 is (more than the target embedding's 100 rows|"
                                         r"outside 1\.\.1,048,576)"):
        DFlashDrafter(dataclasses.replace(cfg, vocab_size=1 << 40), nn.Embedding(100, 32), nn.Linear(32, 100))
    drafter = small_drafter()
    with pytest.raises(ValueError, match="target_hidden has width"):
        drafter(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], torch.zeros(1, 3, 32), torch.arange(3))


def _blocks(drafter, ids, feats, anchors, backend="sdpa"):
    """Hidden states of blocks at ``anchors`` in one batched call: (N, B, H)."""
    cfg = drafter.config
    b, t = cfg.block_size, ids.shape[0]
    anchors_t = torch.tensor([anchors])
    block = torch.full((1, len(anchors), b), cfg.mask_token_id)
    block[0, :, 0] = ids[anchors_t[0]]
    pos = anchors_t[:, :, None] + torch.arange(b)
    masks = training_masks(anchors_t, b, t, cfg.layer_types, cfg.sliding_window, backend)
    with torch.no_grad():
        out = drafter(block.view(1, -1), pos.view(1, -1), feats[None], torch.arange(t), masks)
    return out.view(len(anchors), b, -1)


@pytest.mark.parametrize("layer_types, window", [(None, None), (["sliding_attention", "full_attention"], 5)])
def test_block_never_sees_later_context(layer_types, window):
    drafter = small_drafter(layer_types=layer_types or [], sliding_window=window)
    torch.manual_seed(1)
    ids, feats = torch.randint(0, 99, (30,)), torch.randn(30, 64)
    anchors = [4, 12, 20]
    base = _blocks(drafter, ids, feats, anchors)

    later = feats.clone()
    later[12:] += torch.randn(18, 64)  # from the second anchor on (its own position included)
    out = _blocks(drafter, ids, later, anchors)
    torch.testing.assert_close(out[:2], base[:2], rtol=0, atol=0)  # blocks at 4 and 12 unchanged
    assert (out[2] - base[2]).abs().max() > 1e-3  # the block at 20 sees positions 12..19

    earlier = feats.clone()
    earlier[11] += torch.randn(64)  # just before the second anchor
    out = _blocks(drafter, ids, earlier, anchors)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=0)
    assert (out[1] - base[1]).abs().max() > 1e-3


@pytest.mark.parametrize("layer_types, window", [(None, None), (["sliding_attention", "full_attention"], 6)])
def test_training_blocks_equal_decoding_blocks(layer_types, window):
    """Blocks computed side by side (training) give what one block after its context gives (decoding)."""
    drafter = small_drafter(layer_types=layer_types or [], sliding_window=window)
    torch.manual_seed(2)
    ids, feats = torch.randint(0, 99, (24,)), torch.randn(24, 64)
    anchors = [3, 9, 17]
    batched = _blocks(drafter, ids, feats, anchors)
    cfg = drafter.config
    for n, a in enumerate(anchors):
        block = torch.full((1, cfg.block_size), cfg.mask_token_id)
        block[0, 0] = ids[a]
        ctx = torch.arange(a)
        masks = decode_masks(a, ctx, cfg.block_size, cfg.layer_types, cfg.sliding_window)
        with torch.no_grad():
            alone = drafter(block, (a + torch.arange(cfg.block_size))[None], feats[None, :a], ctx, masks)
        torch.testing.assert_close(alone[0], batched[n], rtol=1e-5, atol=1e-5)


def test_sliding_window_limits_context():
    drafter = small_drafter(layer_types=["sliding_attention", "sliding_attention"], sliding_window=4)
    torch.manual_seed(3)
    ids, feats = torch.randint(0, 99, (30,)), torch.randn(30, 64)
    base = _blocks(drafter, ids, feats, [20])
    far = feats.clone()
    far[:14] += torch.randn(14, 64)  # further than the window from every query of the block at 20
    torch.testing.assert_close(_blocks(drafter, ids, far, [20]), base, rtol=0, atol=0)
    near = feats.clone()
    near[18] += torch.randn(64)
    assert (_blocks(drafter, ids, near, [20]) - base).abs().max() > 1e-3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_matches_sdpa():
    drafter = small_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    torch.manual_seed(4)
    ids, feats = torch.randint(0, 99, (40,)), torch.randn(40, 64)
    anchors = [2, 7, 15, 30]
    torch.testing.assert_close(_blocks(drafter, ids, feats, anchors, "flex"), _blocks(drafter, ids, feats, anchors),
                               rtol=1e-5, atol=1e-5)
