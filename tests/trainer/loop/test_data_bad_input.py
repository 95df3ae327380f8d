"""Bad training input is a clear error before any step: layer ids the target lacks, no mask token."""

from __future__ import annotations

import shutil

import pytest
from dfp_shared.specs.train import TrainSpec
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.loop.prepare import TrainError, prepare

from tests.trainer.train_support import run_config, tiny_spec


def test_layer_ids_outside_the_target(tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/o",
                                              num_draft_layers=2, target_layer_ids=[1, 12]))
    with pytest.raises(TrainError, match=r"target_layer_ids \[12\] do not exist in the target, which has 8 layers"):
        prepare(run_config(spec), DistInfo())
    shallow = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/o",
                                                 num_draft_layers=6))
    with pytest.raises(TrainError, match="too shallow"):
        prepare(run_config(shallow), DistInfo())


def test_target_without_mask_token(tmp_path, tiny_qwen3_dir, tiny_dataset, qwen3_tokenizer_dir):
    target = tmp_path / "no-mask"
    shutil.copytree(tiny_qwen3_dir, target)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the plain Qwen3 tokenizer: no <|MASK|>
        shutil.copy(qwen3_tokenizer_dir / name, target / name)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    spec = TrainSpec.model_validate(tiny_spec(tiny_dataset, target, f"file://{tmp_path}/o", mask_token="<|MASK|>"))
    with pytest.raises(TrainError, match=r"no mask token '<\|MASK\|>'"):
        prepare(run_config(spec), DistInfo())
    # (`auto`, the default, takes a spare special token instead: tests/trainer/drafter/test_model_target_parts.py
    # and the Llama demo in tests/e2e/test_hybrid_pipeline.py)
