"""Drafter options of a train job: per-layer attention, sliding window and mask token reach the export;
bad values are field errors; scratch goes to the configured work directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.store import open_store
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.target_parts import load_target_parts
from dfp_trainer.export import zlab as export_module
from dfp_trainer.loop.prepare import TrainError, prepare
from dfp_trainer.run import run_local
from dfp_trainer.settings import TrainerSettings, scratch_dir
from pydantic import ValidationError

from tests.trainer.train_support import final_weights, run_config, tiny_spec, torch_threads

BASE = dict(dataset="file:///d", target="file:///t", output="file:///o", num_draft_layers=2)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def _field_error(**fields) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as info:
        TrainSpec.model_validate({**BASE, **fields})
    (err,) = info.value.errors()
    return err["loc"], err["msg"]


def test_bad_drafter_options_are_errors_naming_the_field():
    loc, msg = _field_error(layer_types=["full_attention"])
    assert loc == ("layer_types",) and "1 layer types but num_draft_layers is 2" in msg
    loc, msg = _field_error(layer_types=["full_attention", "local"])
    assert loc == ("layer_types", 1) and "'full_attention' or 'sliding_attention'" in msg
    loc, msg = _field_error(layer_types=["sliding_attention", "full_attention"])
    assert loc == ("sliding_window",) and "required" in msg
    loc, msg = _field_error(layer_types=["sliding_attention", "full_attention"], sliding_window=0)
    assert loc == ("sliding_window",) and "greater than or equal to 1" in msg
    loc, msg = _field_error(sliding_window=64)
    assert loc == ("sliding_window",) and "no draft layer is sliding_attention" in msg
    loc, _ = _field_error(mask_token="")
    assert loc == ("mask_token",)
    spec = TrainSpec.model_validate({**BASE, "layer_types": ["sliding_attention", "full_attention"],
                                     "sliding_window": 16})
    assert spec.layer_types == ["sliding_attention", "full_attention"] and spec.mask_token == "auto"


def test_layer_types_reach_the_exported_drafter_which_loads_back(tmp_path, tiny_qwen3_dir, tiny_dataset, monkeypatch):
    """A short real run (settings -> run_local -> train -> export); scratch lives in the work directory."""
    staged = []
    real_export = export_module.export_drafter

    def spy(drafter, out_dir, *args, **kwargs):
        staged.append(Path(out_dir))
        return real_export(drafter, out_dir, *args, **kwargs)

    monkeypatch.setattr(export_module, "export_drafter", spy)
    output, work = f"file://{tmp_path}/out", tmp_path / "work" / "nested"
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, output, steps=2, num_draft_layers=2,
                                              layer_types=["sliding_attention", "full_attention"],
                                              sliding_window=8))
    result = run_local(spec, TrainerSettings(device="cpu", work_dir=str(work)), resume=False)
    assert result.completed and result.step == 2

    assert len(staged) == 1 and staged[0].parent == work and not staged[0].exists()  # staged there, cleaned up
    out = open_store(output)
    config = json.loads(out.get("drafter/config.json"))
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 8 and config["use_sliding_window"] is True
    parts = load_target_parts(tiny_qwen3_dir)
    drafter_dir = tmp_path / "out" / "drafter"
    loaded = load_exported(drafter_dir, parts.embed_tokens, parts.lm_head)
    assert loaded.config.layer_types == ["sliding_attention", "full_attention"]
    assert loaded.config.sliding_window == 8
    from dfp_shared.models.tokenizer_assets import load_tokenizer

    assert loaded.config.mask_token_id == load_tokenizer(tiny_qwen3_dir).convert_tokens_to_ids("<|MASK|>")
    _, weights = final_weights(output)
    state = loaded.state_dict()
    assert set(state) <= set(weights)  # the export holds the trained weights of the last checkpoint
    assert all(weights[k].equal(state[k]) for k in state)


def test_mask_token_of_the_spec_is_used_or_named_when_missing(tmp_path, tiny_qwen3_dir, tiny_dataset):
    from dfp_shared.models.tokenizer_assets import load_tokenizer

    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/o",
                                              mask_token="<|fim_pad|>"))
    setup = prepare(run_config(spec), DistInfo())
    assert setup.drafter.config.mask_token_id == load_tokenizer(tiny_qwen3_dir).convert_tokens_to_ids("<|fim_pad|>")
    missing = spec.model_copy(update={"mask_token": "<|NO_SUCH_MASK|>"})
    with pytest.raises(TrainError, match=r"no mask token '<\|NO_SUCH_MASK\|>'"):
        prepare(run_config(missing), DistInfo())


def test_scratch_dir_creates_the_work_directory(tmp_path):
    work = tmp_path / "a" / "b"
    with scratch_dir(str(work), "x-") as tmp:
        assert Path(tmp).parent == work and Path(tmp).name.startswith("x-")
    assert work.is_dir() and not Path(tmp).exists()
    with scratch_dir("", "x-") as tmp:
        assert Path(tmp).parent != work
