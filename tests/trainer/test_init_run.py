"""A train run of each family whose draft layers start from the target's (``init: target_layers``): set up from the
target's tensors, trained a few steps, evaluated by the project's decoder, exported and loaded back."""

from __future__ import annotations

import json

import pytest
import torch
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.store import open_store
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.target_parts import load_target_parts
from dfp_trainer.loop.prepare import prepare
from dfp_trainer.run import run_local
from dfp_trainer.settings import TrainerSettings
from safetensors.torch import load_file

from tests.trainer.train_support import run_config, tiny_spec, torch_threads

FAMILIES = {"dflash": {}, "dspark": dict(markov_rank=8),
            "dflash2": dict(conv_kernel_size=3, conv_group_size=32, selector_rank=8, selector_top_k=4)}


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def test_the_run_starts_from_the_targets_last_layers(tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", num_draft_layers=2, init="target_layers")
    setup = prepare(run_config(spec), DistInfo())
    weights = load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))
    for j, layer in enumerate((6, 7)):  # of 8 target layers
        for name in ("self_attn.q_proj.weight", "self_attn.k_norm.weight", "mlp.down_proj.weight",
                     "post_attention_layernorm.weight"):
            assert torch.equal(setup.initial_state[f"layers.{j}.{name}"], weights[f"model.layers.{layer}.{name}"])
    assert torch.equal(setup.initial_state["norm.weight"], weights["model.norm.weight"])
    random = prepare(run_config({**spec, "init": "random"}), DistInfo())
    assert not torch.equal(random.initial_state["layers.0.self_attn.q_proj.weight"], setup.initial_state["layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_run_from_the_targets_layers_trains_and_exports(family, tmp_path, tiny_qwen3_dir, tiny_dataset, request):
    # the DFlash run reads its features from the target service: the layers still come from the target's directory
    target_url = f"127.0.0.1:{request.getfixturevalue('target_server').port}" if family == "dflash" else "inprocess"
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", family=family,
                                              init="target_layers", num_draft_layers=2, steps=4, lr=1e-2,
                                              eval_prompts=2, eval_max_new_tokens=8, **FAMILIES[family]))
    result = run_local(spec, TrainerSettings(device="cpu", work_dir=str(tmp_path / "work"), target_url=target_url),
                       resume=False)
    assert result.completed and len(result.history) == 4
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in result.history)
    report = json.loads(open_store(f"file://{tmp_path}/out").get("report.json"))
    assert report["evaluation"]["tau_trained"] >= 1.0 and report["evaluation"]["tau_untrained"] >= 1.0
    parts = load_target_parts(tiny_qwen3_dir)
    loaded = load_exported(tmp_path / "out" / "drafter", parts.embed_tokens, parts.lm_head)
    assert loaded.config.family == family and loaded.config.num_hidden_layers == 2


def test_unit_logits_scales_only_the_final_norm(tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", num_draft_layers=2, init="unit_logits")
    scaled = prepare(run_config(spec), DistInfo()).initial_state
    random = prepare(run_config({**spec, "init": "random"}), DistInfo()).initial_state
    head = load_target_parts(tiny_qwen3_dir).lm_head.weight.float()
    expected = 1.0 / head.pow(2).sum(dim=1).mean().sqrt()
    assert torch.allclose(scaled["norm.weight"], torch.full_like(scaled["norm.weight"], float(expected)))
    assert torch.equal(random["norm.weight"], torch.ones_like(random["norm.weight"]))
    assert scaled.keys() == random.keys()
    assert all(torch.equal(scaled[k], random[k]) for k in scaled if k != "norm.weight")
    # a unit-RMS state through the scaled norm and the head: logits of unit standard deviation on average
    state = torch.randn(256, head.shape[1])
    logits = (state / state.pow(2).mean(-1, keepdim=True).sqrt() * scaled["norm.weight"]) @ head.T
    assert 0.8 < float(logits.std(dim=1).pow(2).mean().sqrt()) < 1.2


def test_unit_logits_is_a_start_of_its_own(tiny_qwen3_dir, tiny_dataset, tmp_path):
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", init="unit_logits",
                     init_from=f"file://{tmp_path}/other")
    with pytest.raises(ValueError, match="init_from and init 'unit_logits'"):
        TrainSpec.model_validate(spec)
