"""The quality benchmarks read a lever's name as the train-spec changes it stands for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_quality  # noqa: E402
import bench_quality_real  # noqa: E402


def test_a_named_lever_and_composed_parts():
    assert bench_quality.lever_recipe("loss=dpace") == {"loss": "dpace"}
    assert bench_quality.lever_recipe("v8k+optimizer=muon+seed=1") == {
        "draft_vocab_size": 8192, "optimizer": "muon", "seed": 1}
    assert bench_quality.lever_recipe("v8k+peer")["anchor_spread"] == "batch"


def test_the_real_target_reads_its_own_levers():
    assert bench_quality_real.lever_recipe("muon+family=dflash2") == {"optimizer": "muon", "family": "dflash2"}
    assert bench_quality_real.lever_recipe("optimizer=muon+seed=1") == {"optimizer": "muon", "seed": 1}
    assert bench_quality_real.lever_recipe("layers=3+muon_lr=0.01") == {"num_draft_layers": 3, "muon_lr": 0.01}
    assert bench_quality_real.lever_recipe("muon+family=dspark+seed=1") == {
        "optimizer": "muon", "family": "dspark", "seed": 1}
    assert bench_quality_real.lever_recipe("muon+init=unit_logits+labels=target_argmax+seed=2") == {
        **bench_quality_real.LEVERS["muon+init=unit_logits+labels=target_argmax"], "seed": 2}
    with pytest.raises(ValueError, match="unknown lever 'layers'"):
        bench_quality_real.lever_recipe("layers+seed=1")
