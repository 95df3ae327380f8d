"""A train job with ``draft_vocab_size``: bounded in the spec, refused when impossible, trained, reported, exported."""

from __future__ import annotations

import json

import pytest
import torch
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.store import open_store
from dfp_trainer.components.data.draft_vocab import required_token_ids
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.target_parts import load_target_parts
from dfp_trainer.drafter.vocab import target_ids_of
from dfp_trainer.loop.prepare import TrainError
from dfp_trainer.run import run_local
from dfp_trainer.settings import TrainerSettings
from pydantic import ValidationError

from tests.trainer.train_support import tiny_spec, torch_threads

BASE = dict(dataset="file:///d", target="file:///t", output="file:///o")


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def test_draft_vocab_size_is_bounded_in_the_spec():
    for bad in (0, (1 << 20) + 1):
        with pytest.raises(ValidationError) as info:
            TrainSpec.model_validate({**BASE, "draft_vocab_size": bad})
        assert info.value.errors()[0]["loc"] == ("draft_vocab_size",)
    assert TrainSpec.model_validate(BASE).draft_vocab_size is None
    schema = TrainSpec.model_json_schema()["properties"]["draft_vocab_size"]["anyOf"][0]
    assert schema["minimum"] == 1 and schema["maximum"] == 1 << 20


def _run(tmp_path, target, dataset, **fields):
    spec = TrainSpec.model_validate(tiny_spec(dataset, target, f"file://{tmp_path}/out", **fields))
    return run_local(spec, TrainerSettings(device="cpu", work_dir=str(tmp_path / "work")), resume=False)


def test_impossible_vocabularies_fail_the_run_before_any_step(tmp_path, tiny_qwen3_dir, tiny_dataset):
    rows = load_target_parts(tiny_qwen3_dir).lm_head.weight.shape[0]
    with pytest.raises(TrainError, match=f"draft_vocab_size {rows + 1} asks for more rows than the target's "
                                         f"vocabulary has \\({rows}\\)"):
        _run(tmp_path, tiny_qwen3_dir, tiny_dataset, draft_vocab_size=rows + 1)
    with pytest.raises(TrainError, match="draft_vocab_size 2 cannot hold the 5 tokens the chat template and the stop "
                                         "tokens need"):
        _run(tmp_path, tiny_qwen3_dir, tiny_dataset, draft_vocab_size=2)


def test_a_pruned_vocabulary_trains_reports_its_coverage_and_exports_the_targets_rows(tmp_path, tiny_qwen3_dir,
                                                                                    tiny_dataset):
    result = _run(tmp_path, tiny_qwen3_dir, tiny_dataset, draft_vocab_size=256, steps=20, lr=1e-2, eval_prompts=2,
                  eval_max_new_tokens=8)
    assert result.completed
    losses = [r["loss"] for r in result.history]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    report = json.loads(open_store(f"file://{tmp_path}/out").get("report.json"))
    vocab = report["draft_vocab"]
    assert vocab["draft_vocab_size"] == 256 and 0.5 < vocab["coverage"] <= 1.0
    assert vocab["trained_tokens_covered"] <= vocab["trained_tokens"]
    assert result.outputs["draft_vocab_coverage"] == vocab["coverage"]
    assert report["evaluation"]["tau_trained"] >= 1.0  # the project's decoder ran over the pruned vocabulary
    assert "out_of_vocab_share" in report["evaluation"]["heldout_trained"]

    parts = load_target_parts(tiny_qwen3_dir)
    for layout in ("drafter", "drafter-speculators"):
        config = json.loads((tmp_path / "out" / layout / "config.json").read_text())
        assert config["draft_vocab_size"] == 256
    loaded = load_exported(tmp_path / "out" / "drafter", parts.embed_tokens, parts.lm_head)
    ids = target_ids_of(loaded.d2t)
    assert set(required_token_ids(load_tokenizer(tiny_qwen3_dir), True)) <= set(ids.tolist())
    assert bool((ids[1:] > ids[:-1]).all())
    assert torch.equal(loaded.lm_head.weight, parts.lm_head.weight[ids])  # the target's rows, kept frozen


def test_a_pruned_run_resumes_and_refuses_a_checkpoint_of_another_vocabulary(tmp_path, tiny_qwen3_dir, tiny_dataset):
    settings = TrainerSettings(device="cpu", work_dir=str(tmp_path / "work"))

    def spec(**fields):
        return TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out",
                                                  checkpoint_every=1, **fields))

    assert run_local(spec(steps=2, draft_vocab_size=64), settings, resume=False).completed
    resumed = run_local(spec(steps=3, draft_vocab_size=64), settings, resume=True)
    assert resumed.completed and resumed.step == 3 and resumed.history[0]["step"] == 1  # continued, not restarted
    with pytest.raises(TrainError, match="its draft vocabulary differs from the one this run chose"):
        run_local(spec(steps=4, draft_vocab_size=96), settings, resume=True)
