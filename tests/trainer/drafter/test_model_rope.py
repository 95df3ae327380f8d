"""The drafter follows the target's RoPE: its cos/sin are transformers' Qwen3 ones for the target's
``rope_parameters``, and the export carries them and loads back to the same outputs."""

from __future__ import annotations

import json

import pytest
import torch
from dfp_trainer.drafter.attention import training_masks
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.model import DFlashDrafter
from dfp_trainer.export.zlab import export_drafter
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from tests.trainer.drafter_support import one_thread

TARGET = {"num_hidden_layers": 8, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "vocab_size": 100,
          "max_position_embeddings": 512}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 5e5},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 128},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
}
POSITIONS = torch.arange(700)[None]  # beyond max_position_embeddings: dynamic RoPE rescales


def _target(rope: dict) -> dict:
    return {**TARGET, "rope_parameters": dict(rope)}


def _drafter(target: dict, seed: int = 0) -> DFlashDrafter:
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=4, mask_token_id=99)
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, nn.Embedding(100, 32), nn.Linear(32, 100, bias=False))


def _cos_sin(rotary: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary(torch.zeros(1, dtype=torch.float32), POSITIONS)


def _outputs(drafter: DFlashDrafter) -> torch.Tensor:
    cfg = drafter.config
    torch.manual_seed(5)
    anchors = torch.tensor([[100, 300, 560]])  # the last block lies past max_position_embeddings
    block = torch.randint(0, 99, (1, 3, cfg.block_size))
    pos = anchors[:, :, None] + torch.arange(cfg.block_size)
    masks = training_masks(anchors, cfg.block_size, 600, cfg.layer_types, cfg.sliding_window, "sdpa")
    with torch.no_grad(), one_thread():
        return drafter(block.view(1, -1), pos.view(1, -1), torch.randn(1, 600, 64), torch.arange(600), masks)


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_cos_sin_are_transformers_qwen3_for_the_targets_rope(kind):
    target = _target(ROPES[kind])
    drafter = _drafter(target)
    assert drafter.config.rope_parameters["rope_type"] == kind
    expected = Qwen3RotaryEmbedding(Qwen3Config(**target))
    for got, want in zip(_cos_sin(drafter.rotary), _cos_sin(expected), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_legacy_rope_scaling_and_top_level_theta_are_read():
    target = {**TARGET, "rope_theta": 2e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    drafter = _drafter(target)
    assert drafter.config.rope_parameters == {"rope_type": "linear", "rope_theta": 2e4, "factor": 2.0}
    assert drafter.config.rope_theta == 2e4
    expected = Qwen3RotaryEmbedding(Qwen3Config(**target))
    for got, want in zip(_cos_sin(drafter.rotary), _cos_sin(expected), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rotary_keys_a_qwen3_layer_has_not_are_left_out():
    """A hybrid target's partial rotary and multimodal sections belong to its attention, not to a Qwen3 layer."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
            "mrope_interleaved": True}
    drafter = _drafter(_target(rope))
    assert drafter.config.rope_parameters == {"rope_type": "default", "rope_theta": 1e7}
    cos, _ = _cos_sin(drafter.rotary)
    assert cos.shape[-1] == drafter.config.head_dim


def test_theta_given_twice_must_agree():
    with pytest.raises(ValueError, match="differs from rope_theta"):
        DrafterConfig(**DrafterConfig.for_target(_target(ROPES["linear"]), mask_token_id=99).__dict__
                      | {"rope_theta": 123.0})


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_export_carries_the_rope_and_loads_back_to_the_same_outputs(kind, tmp_path):
    drafter = _drafter(_target(ROPES[kind]))
    before = _outputs(drafter)  # first: dynamic RoPE keeps the frequencies of the longest positions it has seen
    out = export_drafter(drafter, tmp_path / kind)
    config = json.loads((out / "config.json").read_text())
    assert {**config["rope_parameters"], **ROPES[kind]} == config["rope_parameters"]  # the target's, standardised
    assert config["rope_parameters"] == drafter.config.rope_parameters
    assert config["rope_theta"] == ROPES[kind]["rope_theta"]
    expected = Qwen3RotaryEmbedding(Qwen3Config(**config))  # what a Qwen3-based engine computes from the export
    for got, want in zip(_cos_sin(drafter.rotary), _cos_sin(expected), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    loaded = load_exported(out, drafter.embed_tokens, drafter.lm_head)
    assert loaded.config == drafter.config
    torch.testing.assert_close(_outputs(loaded), before, rtol=0, atol=0)
    if kind != "default":  # the RoPE is what the drafter computes with: the same weights under default RoPE differ
        plain = _drafter(_target(ROPES["default"]))
        plain.load_state_dict(drafter.state_dict())
        assert (_outputs(plain) - before).abs().max() > 1e-4
