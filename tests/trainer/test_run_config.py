"""One RunConfig per run: composed once from the spec and the settings where the run starts, and the
drafter config derived from it is the one the run trains."""

from __future__ import annotations

import dataclasses

import pytest
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_shared.specs.train import TrainSpec
from dfp_trainer import run
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.target_parts import load_target_parts
from dfp_trainer.loop.prepare import TrainError, prepare
from dfp_trainer.run_config import RunConfig
from dfp_trainer.settings import TrainerSettings

from tests.trainer.train_support import run_config, tiny_spec, torch_threads

BASE = dict(dataset="file:///d", target="file:///t", output="file:///o/")


def test_composed_from_spec_and_settings_with_the_named_target():
    settings = TrainerSettings(target_url="dns:///default:1", target_endpoints='{"big": "dns:///big:1"}',
                               fetch_inflight=7)
    config = RunConfig.compose(TrainSpec.model_validate({**BASE, "target_endpoint": "big"}), settings, resume=False)
    assert config.target_address == "dns:///big:1" and config.settings is settings
    assert config.resume is False and config.evaluate is True and config.settings.fetch_inflight == 7
    assert config.output_uri("checkpoints/") == "file:///o/checkpoints/"
    assert RunConfig.compose(TrainSpec.model_validate(BASE), settings).target_address == "dns:///default:1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.resume = True  # type: ignore[misc]
    with pytest.raises(ValueError, match="'small' is not configured"):
        RunConfig.compose(TrainSpec.model_validate({**BASE, "target_endpoint": "small"}), settings)


def test_run_local_composes_once_and_passes_it_down(monkeypatch):
    composed, trained = [], []
    real = RunConfig.compose

    def compose(*args, **kwargs):
        composed.append(real(*args, **kwargs))
        return composed[-1]

    monkeypatch.setattr(RunConfig, "compose", compose)
    monkeypatch.setattr(run, "train", lambda config, info, hooks: trained.append(config) or "result")
    spec, settings = TrainSpec.model_validate(BASE), TrainerSettings(device="cpu")
    assert run.run_local(spec, settings, resume=False) == "result"
    assert len(composed) == 1 and trained == composed
    assert trained[0].spec is spec and trained[0].settings is settings and trained[0].resume is False

    with pytest.raises(TrainError, match="target_endpoint 'nope' is not configured"):
        run.run_local(TrainSpec.model_validate({**BASE, "target_endpoint": "nope"}), settings)
    assert len(trained) == 1


def test_derived_drafter_config_is_the_one_the_run_trains(tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/o", num_draft_layers=2,
                                              block_size=8, layer_types=["sliding_attention", "full_attention"],
                                              sliding_window=16))
    config = run_config(spec)
    parts = load_target_parts(tiny_qwen3_dir)
    mask_id = load_tokenizer(tiny_qwen3_dir).convert_tokens_to_ids("<|MASK|>")  # what `auto` picks for it
    derived = config.drafter_config(parts.config, mask_id)
    # what the run built before there was one config: the same constructor, field by field from the spec
    before = DrafterConfig.for_target(parts.config, num_layers=spec.num_draft_layers, block_size=spec.block_size,
                                      mask_token_id=mask_id, target_layer_ids=spec.target_layer_ids,
                                      layer_types=spec.layer_types, sliding_window=spec.sliding_window)
    assert derived == before
    assert derived.num_hidden_layers == 2 and derived.block_size == 8 and derived.sliding_window == 16
    with torch_threads(1):
        setup = prepare(config, DistInfo())
    assert setup.drafter.config == derived and setup.config is config and setup.spec is spec
