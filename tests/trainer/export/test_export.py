"""The exported drafter directory: reference format, round trip, and clear errors on bad directories."""

from __future__ import annotations

import json

import pytest
import torch
from dfp_trainer.drafter.attention import training_masks
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.export.zlab import export_drafter
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
    assert config["dflash_config"] == {"mask_token_id": 99, "target_layer_ids": [1, 4], "block_size": 4,
                                       "swa_window_size": 8}
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 8
    assert "is_causal" not in config and config["dflash_config"]["swa_window_size"] == 8
    assert config["tie_word_embeddings"] is False
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]

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
    with pytest.raises(ValueError, match="names none of DFlashDraftModel, Qwen3DSparkModel, DFlash2DraftModel"):
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


_AUTOMODEL_SCRIPT = """
import sys
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel
drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
assert type(drafter).__name__ == "DFlashDraftModel", type(drafter)
x = load_file(sys.argv[2])
with torch.no_grad():
    hidden = drafter(x["noise_embedding"], x["target_hidden"], x["position_ids"])
save_file({"logits": hidden @ x["lm_head"].T}, sys.argv[3])
"""


@pytest.mark.parametrize("layer_types, window", [(None, None), (["sliding_attention", "full_attention"], 3)])
def test_automodel_loads_the_export_in_a_fresh_process(tmp_path, layer_types, window):
    """transformers' AutoModel (trust_remote_code) builds the export's own modeling file: same draft logits
    as the project's drafter decoding the same block, sliding layers included."""
    import ast
    import os
    import subprocess
    import sys

    from dfp_trainer.drafter.attention import decode_masks

    drafter = small_drafter(layer_types=layer_types or [], sliding_window=window)
    out = export_drafter(drafter, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "modeling_dflash.py"]
    imported = {n.names[0].name.split(".")[0] if isinstance(n, ast.Import) else (n.module or "").split(".")[0]
                for n in ast.walk(ast.parse((out / "modeling_dflash.py").read_text()))
                if isinstance(n, ast.Import | ast.ImportFrom)}
    assert imported <= {"__future__", "torch", "transformers"}, imported

    cfg = drafter.config
    torch.manual_seed(7)
    anchor, ctx = 9, torch.arange(9)
    block = torch.full((1, cfg.block_size), cfg.mask_token_id)
    block[0, 0] = 5
    feats, pos = torch.randn(1, 9, 64), (anchor + torch.arange(cfg.block_size))[None]
    masks = decode_masks(anchor, ctx, cfg.block_size, cfg.layer_types, cfg.sliding_window)
    with torch.no_grad():
        expected = drafter.logits(drafter(block, pos, feats, ctx, masks))
        inputs = {"noise_embedding": drafter.embed_block(block), "target_hidden": feats,
                  "position_ids": torch.cat([ctx[None], pos], dim=1), "lm_head": drafter.lm_head.weight.detach()}
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(tmp_path / "inputs.safetensors"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", _AUTOMODEL_SCRIPT, str(out), str(tmp_path / "inputs.safetensors"),
                    str(tmp_path / "logits.safetensors")], check=True, env=env, timeout=300)
    got = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
