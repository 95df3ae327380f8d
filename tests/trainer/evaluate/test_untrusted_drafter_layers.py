"""An ``evaluate`` job given a stored drafter whose 1 KB config.json states 200000000 draft layers and no
layer_types: the job's loading refuses it naming the file and the field, within a bounded address space,
before the drafter is built (its weights file is empty: it is never read)."""

from __future__ import annotations

import json

import pytest
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_shared.specs.evaluate import EvaluateSpec
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id
from dfp_trainer.evaluate.job import EvaluateError, load_models

from tests.trainer.drafter.test_stored_config_bounds import ATTACK_LAYERS, bounded_memory


def test_the_evaluate_job_refuses_a_drafter_of_200000000_layers(tmp_path, tiny_qwen3_dir):
    target = load_target_parts(tiny_qwen3_dir).config
    config = DrafterConfig.for_target(target, num_layers=1, block_size=4,
                                      mask_token_id=mask_token_id(load_tokenizer(tiny_qwen3_dir))).to_config_dict()
    del config["layer_types"], config["max_window_layers"]
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "config.json").write_text(json.dumps({**config, "num_hidden_layers": ATTACK_LAYERS}))
    (hostile / "model.safetensors").write_bytes(b"")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Name three rivers."}) + "\n")
    spec = EvaluateSpec(drafter=hostile.as_uri(), target=f"file://{tiny_qwen3_dir}",
                        prompts=[(tmp_path / "p.jsonl").as_uri()], output=(tmp_path / "eval").as_uri(),
                        max_new_tokens=4)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with bounded_memory(extra=1 << 30), pytest.raises(EvaluateError) as caught:  # the tiny target loads within it
        load_models(spec, "cpu", str(scratch), None)
    assert f"{hostile}/config.json: num_hidden_layers must be 1..64, got {ATTACK_LAYERS}" in str(caught.value)
