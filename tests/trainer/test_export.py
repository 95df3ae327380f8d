"""The exported drafter directory: reference format, round trip, and clear errors on bad directories."""

from __future__ import annotations

import json

import pytest
import torch
from dfp_trainer.attention import training_masks
from dfp_trainer.export import export_drafter, load_exported
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.trainer.drafter_support import small_drafter


def _draft_logits(drafter):
    cfg = drafter.config
    torch.manual_seed(5)
    ids, feats = torch.randint(0, 99, (1, 20)), torch.randn(1, 20, 64)
    anchors = torch.tensor([[3, 9, 14]])
    block = torch.full((1, 3, cfg.block_size), cfg.mask_token_id)
    block[0, :, 0] = ids[0, anchors[0]]
    pos = anchors[:, :, None] + torch.arange(cfg.block_size)
    masks = training_masks(anchors, cfg.block_size, 20, cfg.layer_types, cfg.sliding_window, "sdpa")
    with torch.no_grad():
        return drafter.logits(drafter(block.view(1, -1), pos.view(1, -1), feats, torch.arange(20), masks))


def test_export_is_in_reference_format_and_round_trips(tmp_path):
    drafter = small_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    out = export_drafter(drafter, tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 4 and config["num_target_layers"] == 8
    assert config["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": [1, 4], "block_size": 4}
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 8
    assert config["is_causal"] is False and config["tie_word_embeddings"] is False
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    loaded = load_exported(out, drafter.embed_tokens, drafter.lm_head)
    assert loaded.config == drafter.config
    torch.testing.assert_close(_draft_logits(loaded), _draft_logits(drafter), rtol=0, atol=0)


def test_export_in_bfloat16(tmp_path):
    drafter = small_drafter()
    out = export_drafter(drafter, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_exported(out, drafter.embed_tokens, drafter.lm_head)
    assert loaded.fc.weight.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.fc.weight.float(), drafter.fc.weight.to(torch.bfloat16).float())


def test_load_exported_bad_directories(tmp_path):
    drafter = small_drafter()
    embed, head = drafter.embed_tokens, drafter.lm_head
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_exported(tmp_path / "missing", embed, head)

    out = export_drafter(drafter, tmp_path / "renamed")
    state = load_file(str(out / "model.safetensors"))
    state["layers.0.attn.q_proj.weight"] = state.pop("layers.0.self_attn.q_proj.weight")
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor names .*self_attn.q_proj"):
        load_exported(out, embed, head)

    out = export_drafter(drafter, tmp_path / "arch")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(ValueError, match="does not name DFlashDraftModel"):
        load_exported(out, embed, head)
    del config["dflash_config"]["mask_token_id"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="dflash_config.mask_token_id missing"):
        load_exported(out, embed, head)
    config["dflash_config"]["mask_token_id"] = 99
    config["dflash_config"]["target_layer_ids"] = [1, 9]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: target_layer_ids \[9\]"):
        load_exported(out, embed, head)
    (out / "config.json").write_text("{\n  \"architectures\": [\n")
    with pytest.raises(ValueError, match="config.json: line 3: not valid JSON"):
        load_exported(out, embed, head)
