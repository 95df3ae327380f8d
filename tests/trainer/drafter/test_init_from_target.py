"""Draft layers started from the target's decoder layers (``init: target_layers``), for every family."""

from __future__ import annotations

import pytest
import torch
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.specs.train import TrainSpec
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.families import build_drafter
from dfp_trainer.drafter.init_from_target import (
    LAYER_TENSORS,
    QK_NORMS,
    init_from_target_layers,
    init_layer_ids,
)
from dfp_trainer.drafter.target_parts import load_target_parts
from safetensors.torch import load_file

FAMILIES = {"dflash": {}, "dspark": dict(markov_rank=4, confidence_head=True),
            "dflash2": dict(dflash2=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=4))}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, qwen3_tokenizer_dir):
    from dfp_dev.targets.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), qwen3_tokenizer_dir, num_layers=6)


def drafter_of(model_dir, family: str, num_layers: int = 2):
    parts = load_target_parts(model_dir)
    config = DrafterConfig.for_target(parts.config, num_layers=num_layers, block_size=4, mask_token_id=5,
                                      **FAMILIES[family])
    torch.manual_seed(0)
    return build_drafter(config, parts.embed_tokens, parts.lm_head)


def target_tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("target", ["qwen3", "llama"])
def test_the_draft_layers_are_the_targets_last_layers(family, target, request):
    model_dir = request.getfixturevalue("tiny_qwen3_dir" if target == "qwen3" else "tiny_llama_dir")
    drafter = drafter_of(model_dir, family)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    done = init_from_target_layers(drafter, model_dir)
    weights, state = target_tensors(model_dir), drafter.state_dict()
    num_target = {"qwen3": 8, "llama": 6}[target]
    assert done.layer_ids == init_layer_ids(num_target, 2) == [num_target - 2, num_target - 1]
    for j, layer in enumerate(done.layer_ids):
        for name in LAYER_TENSORS + (QK_NORMS if target == "qwen3" else ()):
            assert torch.equal(state[f"layers.{j}.{name}"], weights[f"model.layers.{layer}.{name}"].float()), name
        assert torch.equal(drafter.layers[j].input_layernorm.weight, weights[f"model.layers.{layer}.input_layernorm.weight"])
    assert torch.equal(state["norm.weight"], weights["model.norm.weight"])
    assert torch.equal(state["hidden_norm.weight"], weights[f"model.layers.{done.layer_ids[0]}.input_layernorm.weight"])
    ids, hidden = drafter.config.target_layer_ids, drafter.config.hidden_size
    assert done.feature_layer == max(ids)
    fc = state["fc.weight"].view(hidden, len(ids), hidden)
    for block, layer in enumerate(ids):  # the identity on the deepest feature layer's block, zero elsewhere
        assert torch.equal(fc[:, block], torch.eye(hidden) if layer == max(ids) else torch.zeros(hidden, hidden))
    if target == "llama":  # no q/k norms in a Llama layer: the drafter's stay at their start (ones)
        assert done.kept == [f"layers.{j}.{n}" for j in range(2) for n in QK_NORMS]
        assert all(torch.equal(state[name], torch.ones(16)) for name in done.kept)
    else:
        assert done.kept == []
    copied = set(done.copied)
    untouched = [k for k in state if k not in copied]
    assert all(torch.equal(state[k], before[k]) for k in untouched)  # the family's own modules keep their start
    family_modules = {"dspark": ("markov_head.", "confidence_head."), "dflash2": ("attention_conv", "candidate_selector")}
    for prefix in family_modules.get(family, ()):
        assert any(prefix in k for k in untouched), prefix


def test_the_first_layers_context_keys_are_the_targets(tiny_qwen3_dir):
    """With the deepest context layer just before the copied ones, the first draft layer's keys and values over
    the context are exactly the ones the target's layer computes there."""
    drafter = drafter_of(tiny_qwen3_dir, "dflash")  # 2 draft layers over target layers [1, 5] of 8: copied 6, 7
    assert drafter.config.target_layer_ids == [1, 5]
    init_from_target_layers(drafter, tiny_qwen3_dir)
    target = load_causal_lm(str(tiny_qwen3_dir), device="cpu")
    ids = torch.tensor([[3, 17, 99, 1000, 42, 7]])
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i + 1] for i in drafter.config.target_layer_ids], dim=-1)  # (1, T, K*H)
        context = drafter.hidden_norm(drafter.fc(features))
        layer = target.model.layers[6]
        expected = layer.input_layernorm(states[6])  # layer 6's input: the output of layer 5
        assert torch.allclose(context, expected, atol=1e-6)
        assert torch.allclose(drafter.layers[0].self_attn.k_proj(context), layer.self_attn.k_proj(expected), atol=1e-6)


def test_targets_that_are_not_qwen3_style_are_refused(tiny_hybrid_dir, tiny_qwen3_dir):
    with pytest.raises(ValueError, match="qwen3_5_text target's decoder layers are not Qwen3-style"):
        init_from_target_layers(drafter_of(tiny_hybrid_dir, "dflash"), tiny_hybrid_dir)
    with pytest.raises(ValueError, match="9 draft layers need at most the target's 8"):
        init_layer_ids(8, 9)


def test_the_spec_option():
    base = dict(dataset="file:///d", target="file:///t")
    assert TrainSpec.model_validate(base).init == "random"
    assert TrainSpec.model_validate({**base, "init": "target_layers"}).init == "target_layers"
    with pytest.raises(ValueError, match="init"):
        TrainSpec.model_validate({**base, "init": "target"})
