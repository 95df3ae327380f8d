"""What the serving engines compute is what is trained: the visibility rule of each layer type, and the
config fields of both export layouts read the way vLLM and SGLang read them.

The engines' rules, from their DFlash model sources:

- vLLM (``model_executor/models/qwen3_dflash.py``, ``_dflash_layer_causal`` / ``_resolve_layer_attention``):
  a layer is causal when ``is_causal`` says so, else when ``dflash_config.causal`` says so, else when it
  is a ``sliding_attention`` layer; its window is ``dflash_config.swa_window_size`` or ``sliding_window``
  for sliding layers. Its speculators loader (``configs/speculators/algos.py``, ``update_dflash``) sets
  ``dflash_config.causal = not sliding_window_non_causal`` (default true: non-causal) and
  ``target_layer_ids = aux_hidden_state_layer_ids - 1``.
- SGLang (``srt/models/dflash.py``, ``_get_dflash_layer_attention_params``): full layers are
  ``ENCODER_ONLY`` (non-causal), sliding layers ``DECODER`` (causal) with
  ``window_left = sliding_window - 1``.
- Both: a causal layer with window ``w`` lets a query at position p see keys at p-w+1 .. p.
"""

from __future__ import annotations

import json

import pytest
import torch
from dfp_shared.specs.train import TrainSpec
from dfp_trainer.drafter import modeling_dflash
from dfp_trainer.drafter.attention import FULL, SLIDING, decode_masks, training_masks
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.export.speculators import export_speculators, speculators_config
from pydantic import ValidationError

from tests.trainer.drafter_support import small_config, small_drafter

LAYOUTS = {"full": ([FULL, FULL], None), "sliding": ([SLIDING, SLIDING], 3), "mixed": ([SLIDING, FULL], 3)}


def _vllm_layers(config: dict) -> list[tuple[bool, int | None]]:
    """(causal, window) of each draft layer as vLLM resolves them from a z-lab ``config.json``."""
    dflash = config.get("dflash_config") or {}
    types = config.get("layer_types")
    out = []
    for i in range(config["num_hidden_layers"]):
        if config.get("is_causal") is not None:
            causal = bool(config["is_causal"])
        elif dflash.get("causal") is not None:
            causal = bool(dflash["causal"])
        else:
            causal = bool(types) and types[i] == SLIDING
        sliding = dflash.get("use_swa", False) if types is None else types[i] == SLIDING
        out.append((causal, dflash.get("swa_window_size", config.get("sliding_window")) if sliding else None))
    return out


def _vllm_speculators_to_zlab(config: dict) -> dict:
    """vLLM's speculators loader: the transformers config it builds from a speculators ``config.json``."""
    built = dict(config["transformer_layer_config"])
    aux = config["aux_hidden_state_layer_ids"]
    built["dflash_config"] = {"mask_token_id": config["mask_token_id"], "target_layer_ids": [i - 1 for i in aux],
                              "causal": not config.get("sliding_window_non_causal", True)}
    return built


def _sglang_layers(config: dict) -> list[tuple[bool, int | None]]:
    """(causal, window) per layer as SGLang resolves them (window_left + 1 is the HF-style window)."""
    types = config.get("layer_types") or [FULL] * config["num_hidden_layers"]
    return [(False, None) if t == FULL else (True, (config["sliding_window"] - 1) + 1) for t in types]


def _trained_layers(cfg: DrafterConfig) -> list[tuple[bool, int | None]]:
    return [(t == SLIDING, cfg.sliding_window if t == SLIDING else None) for t in cfg.layer_types]


def _seen(mask: torch.Tensor, q: int) -> list[int]:
    return torch.nonzero(mask[q]).flatten().tolist()


def test_which_keys_each_block_position_sees():
    """Block at anchor 10 of size 4 after 16 context positions: keys 0..15 are context, 16..19 the block."""
    anchors, b, ctx = torch.tensor([[10]]), 4, 16
    masks = training_masks(anchors, b, ctx, [FULL, SLIDING], sliding_window=3, backend="sdpa")
    full, sliding = masks.for_layer(FULL)[0, 0], masks.for_layer(SLIDING)[0, 0]
    block = [ctx + k for k in range(b)]
    for k in range(b):  # query at position 10 + k
        assert _seen(full, k) == list(range(10)) + block  # context before the anchor, the whole block
        window_ctx = [p for p in range(10) if 0 <= 10 + k - p < 3]
        window_block = [block[j] for j in range(k + 1) if k - j < 3]
        assert _seen(sliding, k) == window_ctx + window_block  # causal, within the window
    assert _seen(sliding, 0) == [8, 9, 16] and _seen(sliding, 3) == [17, 18, 19]
    no_window = training_masks(anchors, b, ctx, [FULL], backend="sdpa").for_layer(FULL)[0, 0]
    torch.testing.assert_close(no_window, full)


def test_decoding_masks_apply_the_same_rule():
    one = decode_masks(10, torch.arange(10), 4, [FULL, SLIDING], sliding_window=3)
    assert _seen(one.for_layer(SLIDING)[0, 0], 1) == [9, 10, 11]
    assert _seen(one.for_layer(FULL)[0, 0], 0) == list(range(14))
    config = small_config(layer_types=[SLIDING, FULL], sliding_window=3).qwen3_config()
    hf = modeling_dflash.one_block_masks(config, torch.arange(10)[None], (10 + torch.arange(4))[None])
    for kind in (FULL, SLIDING):
        torch.testing.assert_close(hf[kind], one.for_layer(kind))


def test_layer_type_names_are_the_modeling_files():
    assert (FULL, SLIDING) == (modeling_dflash.FULL_ATTENTION, modeling_dflash.SLIDING_ATTENTION)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_zlab_config_makes_vllm_and_sglang_attend_as_trained(layout):
    types, window = LAYOUTS[layout]
    cfg = small_config(layer_types=types, sliding_window=window)
    config = json.loads(json.dumps(cfg.to_config_dict()))
    assert _vllm_layers(config) == _trained_layers(cfg)
    assert _sglang_layers(config) == _trained_layers(cfg)
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert DrafterConfig.from_config_dict(config) == cfg


@pytest.mark.parametrize("layout", ["full", "sliding"])
def test_speculators_config_makes_vllm_attend_as_trained(layout):
    types, window = LAYOUTS[layout]
    cfg = small_config(layer_types=types, sliding_window=window)
    config = speculators_config(cfg, "/models/target", ["Qwen3ForCausalLM"])
    assert "model_type" not in config  # vLLM recognises the layout by its speculators_config
    for name in ("speculators_model_type", "aux_hidden_state_layer_ids", "mask_token_id", "block_size",
                 "target_hidden_size", "transformer_layer_config", "speculators_config"):
        assert config[name] is not None, name
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.block_size - 1
    assert config["speculators_config"]["verifier"] == {"name_or_path": "/models/target",
                                                        "architectures": ["Qwen3ForCausalLM"]}
    built = _vllm_speculators_to_zlab(config)
    assert built["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids
    assert _vllm_layers(built) == _trained_layers(cfg)


def test_speculators_layer_ids_against_vllms_own_example():
    """vLLM's speculators test: aux_hidden_state_layer_ids [2, 4] are z-lab target_layer_ids [1, 3]."""
    config = speculators_config(small_config(num_target_layers=8, target_layer_ids=[1, 3]), "t")
    assert config["aux_hidden_state_layer_ids"] == [2, 4]
    assert config["sliding_window_non_causal"] is True  # vLLM: dflash_config.causal false


def test_mixed_layout_is_refused_for_speculators(tmp_path):
    drafter = small_drafter(layer_types=[SLIDING, FULL], sliding_window=3)
    with pytest.raises(ValueError, match="speculators layout cannot serve"):
        export_speculators(drafter, tmp_path / "s", "t")
    assert not (tmp_path / "s").exists()
    base = {"dataset": "file:///d/", "target": "file:///t/", "num_draft_layers": 2,
            "layer_types": [SLIDING, FULL], "sliding_window": 3}
    with pytest.raises(ValidationError, match="speculators layout cannot serve"):
        TrainSpec(**base, exports=["zlab", "speculators"])
    assert TrainSpec(**base).export_layouts() == ["zlab"]
    assert TrainSpec(**{**base, "layer_types": [SLIDING, SLIDING]}).export_layouts() == ["zlab", "speculators"]


@pytest.mark.parametrize("field", ["is_causal", "dflash_config.causal"])
def test_config_making_full_layers_causal_is_refused(field):
    config = small_config().to_config_dict()
    if field == "is_causal":
        config["is_causal"] = True
    else:
        config.pop("is_causal")
        config["dflash_config"]["causal"] = True
    with pytest.raises(ValueError, match=f"{field} is true"):
        DrafterConfig.from_config_dict(config)
