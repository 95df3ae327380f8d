"""A pruned-vocabulary drafter exported as vLLM reads it, loaded back by the project and by transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from dfp_trainer.drafter.attention import decode_masks
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.vocab import d2t_of
from dfp_trainer.export.speculators import export_speculators
from dfp_trainer.export.zlab import export_drafter
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.trainer.drafter_support import small_drafter

DRAFT_IDS = torch.tensor([2, 5, 6, 11, 17, 30, 31, 40, 57, 63, 80, 98])


def _block_inputs(drafter, seed: int = 7):
    cfg = drafter.config
    torch.manual_seed(seed)
    anchor, ctx = 9, torch.arange(9)
    block = torch.full((1, cfg.block_size), cfg.mask_token_id)
    block[0, 0] = 5
    feats, pos = torch.randn(1, 9, 64), (anchor + torch.arange(cfg.block_size))[None]
    return block, pos, feats, ctx, decode_masks(anchor, ctx, cfg.block_size, cfg.layer_types, cfg.sliding_window)


def _drafts(drafter, seed: int = 7) -> torch.Tensor:
    block, pos, feats, ctx, masks = _block_inputs(drafter, seed)
    with torch.no_grad():
        return drafter.to_target(drafter.logits(drafter(block, pos, feats, ctx, masks)).argmax(-1))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_export_carries_draft_vocab_size_the_own_head_and_d2t_and_loads_back(tmp_path, dtype):
    drafter = small_drafter(0, DRAFT_IDS)
    out = export_drafter(drafter, tmp_path / "drafter", dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 12 and config["vocab_size"] == 100  # vLLM scatters into vocab_size
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        head, d2t = f.get_tensor("lm_head.weight"), f.get_tensor("d2t")
    assert "t2d" not in names and not any("embed" in n for n in names)
    assert head.shape == (12, 32) and head.dtype == (dtype or torch.float32)
    assert d2t.dtype == torch.int64 and torch.equal(torch.arange(12) + d2t, DRAFT_IDS)  # d2t: the target ids chosen
    torch.testing.assert_close(head.float(), drafter.target_lm_head.weight[DRAFT_IDS].to(head.dtype).float())

    loaded = load_exported(out, drafter.embed_tokens, drafter.target_lm_head)
    assert loaded.config == drafter.config and torch.equal(loaded.d2t, d2t_of(DRAFT_IDS))
    if dtype is None:
        assert torch.equal(_drafts(loaded), _drafts(drafter))
        assert bool(torch.isin(_drafts(loaded), DRAFT_IDS).all())


def test_a_d2t_that_leaves_the_targets_vocabulary_is_refused(tmp_path):
    out = export_drafter(small_drafter(0, DRAFT_IDS), tmp_path / "drafter")
    state = load_file(str(out / "model.safetensors"))
    state["d2t"][-1] = 200  # draft id 11 -> target id 211, past the target's 100 rows
    save_file(state, str(out / "model.safetensors"))
    drafter = small_drafter(0)
    with pytest.raises(ValueError, match="d2t does not map the draft ids to distinct tokens of the target's 100"):
        load_exported(out, drafter.embed_tokens, drafter.lm_head)


def test_the_speculators_export_states_the_draft_vocab_size(tmp_path):
    out = export_speculators(small_drafter(0, DRAFT_IDS), tmp_path / "spec", "/models/target")
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 12 and "draft_vocab_size" not in config["transformer_layer_config"]
    assert config["transformer_layer_config"]["vocab_size"] == 100
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("lm_head.weight").shape == (12, 32)


_AUTOMODEL_SCRIPT = """
import sys
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel
drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
x = load_file(sys.argv[2])
with torch.no_grad():
    hidden = drafter(x["noise_embedding"], x["target_hidden"], x["position_ids"])
    save_file({"drafts": drafter.draft_tokens(hidden), "logits": drafter.target_logits(hidden),
               "d2t": drafter.d2t}, sys.argv[3])
"""


def test_automodel_drafts_what_the_project_drafts_over_the_pruned_vocabulary(tmp_path):
    drafter = small_drafter(0, DRAFT_IDS)
    out = export_drafter(drafter, tmp_path / "drafter")
    block, pos, feats, ctx, _ = _block_inputs(drafter)
    inputs = {"noise_embedding": drafter.embed_block(block), "target_hidden": feats,
              "position_ids": torch.cat([ctx[None], pos], dim=1)}
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(tmp_path / "inputs.safetensors"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", _AUTOMODEL_SCRIPT, str(out), str(tmp_path / "inputs.safetensors"),
                    str(tmp_path / "out.safetensors")], check=True, env=env, timeout=300)
    got = load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(got["d2t"], d2t_of(DRAFT_IDS))
    assert torch.equal(got["drafts"], _drafts(drafter))
    logits = got["logits"][0]  # (B, 100): the draft logits at their target ids, -inf elsewhere (as vLLM scatters)
    assert bool(torch.isinf(logits[:, [i for i in range(100) if i not in DRAFT_IDS.tolist()]]).all())
    assert torch.equal(logits.argmax(-1), got["drafts"][0])
