"""A train job of the DSpark and DFlash2 families: trained, evaluated by the project's decoder, exported as vLLM reads
it."""

from __future__ import annotations

import json

import pytest
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.store import open_store
from dfp_trainer.drafter.families.dflash2.model import DFlash2Drafter
from dfp_trainer.drafter.families.dspark.model import DSparkDrafter
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.target_parts import load_target_parts
from dfp_trainer.run import run_local
from dfp_trainer.settings import TrainerSettings

from tests.trainer.train_support import tiny_spec, torch_threads


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


FAMILIES = {
    "dspark": (dict(markov_rank=8, confidence_loss_weight=0.5), "dspark", DSparkDrafter,
               lambda c: c["architectures"] == ["Qwen3DSparkModel"] and c["markov_rank"] == 8),
    "dflash2": (dict(conv_kernel_size=3, conv_group_size=32, selector_rank=8, selector_top_k=4), "dflash",
                DFlash2Drafter, lambda c: c["architectures"] == ["DFlash2DraftModel"]
                and c["dflash_config"]["selector_top_k"] == 4),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_run_trains_evaluates_and_exports_its_heads(family, tmp_path, tiny_qwen3_dir, tiny_dataset):
    fields, method, module, exported = FAMILIES[family]
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", family=family,
                                              steps=20, lr=1e-2, eval_prompts=2, eval_max_new_tokens=8, **fields))
    result = run_local(spec, TrainerSettings(device="cpu", work_dir=str(tmp_path / "work")), resume=False)
    assert result.completed
    losses = [r["loss"] for r in result.history]
    print(f"{family}: loss over the first 3 steps {sum(losses[:3]) / 3:.3f}, over the last 3 {sum(losses[-3:]) / 3:.3f}")
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    report = json.loads(open_store(f"file://{tmp_path}/out").get("report.json"))
    assert report["evaluation"]["tau_trained"] >= 1.0  # the project's decoder drafted with the family's heads
    assert f'"method": "{method}"' in report["serving"]["vllm"]
    assert not (tmp_path / "out" / "drafter-speculators").exists()  # vLLM reads the family from the zlab layout only
    assert exported(json.loads((tmp_path / "out" / "drafter" / "config.json").read_text()))
    parts = load_target_parts(tiny_qwen3_dir)
    loaded = load_exported(tmp_path / "out" / "drafter", parts.embed_tokens, parts.lm_head)
    assert type(loaded) is module and loaded.config.family == family
