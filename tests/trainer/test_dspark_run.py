"""A train job of the DSpark family: trained, evaluated by the project's decoder, exported as vLLM reads it."""

from __future__ import annotations

import json

import pytest
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage import open_store
from dfp_trainer.drafter.dspark import DSparkDrafter
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.target_parts import load_target_parts
from dfp_trainer.run import run_local
from dfp_trainer.settings import TrainerSettings

from tests.trainer.train_support import tiny_spec, torch_threads


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def test_a_dspark_run_trains_evaluates_and_exports_its_heads(tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", family="dspark",
                                              markov_rank=8, confidence_loss_weight=0.5, steps=20, lr=1e-2,
                                              eval_prompts=2, eval_max_new_tokens=8))
    result = run_local(spec, TrainerSettings(device="cpu", work_dir=str(tmp_path / "work")), resume=False)
    assert result.completed
    losses = [r["loss"] for r in result.history]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    report = json.loads(open_store(f"file://{tmp_path}/out").get("report.json"))
    assert report["evaluation"]["tau_trained"] >= 1.0  # the project's decoder drafted with the Markov head
    assert '"method": "dspark"' in report["serving"]["vllm"]
    assert not (tmp_path / "out" / "drafter-speculators").exists()  # vLLM reads DSpark from the zlab layout only
    config = json.loads((tmp_path / "out" / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 8
    parts = load_target_parts(tiny_qwen3_dir)
    loaded = load_exported(tmp_path / "out" / "drafter", parts.embed_tokens, parts.lm_head)
    assert isinstance(loaded, DSparkDrafter) and loaded.confidence_head is not None
