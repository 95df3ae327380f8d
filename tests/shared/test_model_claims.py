"""A target checkpoint whose config.json claims a model its weights cannot hold is refused before anything is
built: an empty or small weights file under a vast config would otherwise be made at the config's size."""

from __future__ import annotations

import json
import shutil

import pytest
from dfp_shared.jobs.failures import ModelRefused
from dfp_shared.models.loading import check_sized_by_weights, load_causal_lm


def _claiming(src, tmp_path, name, **changes):
    out = tmp_path / name
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_config_claiming_more_than_its_weights_hold_is_refused(tmp_path, tiny_qwen3_dir, tiny_hybrid_dir):
    for real in (tiny_qwen3_dir, tiny_hybrid_dir):
        check_sized_by_weights(real, str(real))  # a real checkpoint's config fits its weights
    assert load_causal_lm(str(tiny_qwen3_dir), device="cpu") is not None
    huge = _claiming(tiny_qwen3_dir, tmp_path, "huge", intermediate_size=4_000_000, num_hidden_layers=64,
                     layer_types=["full_attention"] * 64, max_window_layers=64)
    (huge / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelRefused, match=r"describes [\d,]+ parameters, more than its safetensors files hold"):
        load_causal_lm(str(huge), device="cpu")
    deep = _claiming(tiny_qwen3_dir, tmp_path, "deep", num_hidden_layers=10**7, layer_types=None)
    with pytest.raises(ModelRefused, match=r"num_hidden_layers 10000000 \(1\.\.1024\)"):
        load_causal_lm(str(deep), device="cpu")
