"""The demo's summary line for the predicted τ and the train/serve verdict."""

from __future__ import annotations

from dfp_dev.demo.config import DemoConfig
from dfp_dev.demo.run import pipeline_spec, prediction_line


def test_the_summary_shows_the_predicted_tau_and_flags_a_mismatch(tmp_path):
    honest = {"tau_predicted": 1.07, "tau_gap": -0.29, "tau_gap_noise": 0.34, "train_serve_mismatch": False,
              "mismatch_reason": "within the noise"}
    assert prediction_line(honest) == ("predicted from held-out accuracy: 1.07 (gap -0.29 ± 0.34); "
                                       "no train/serve mismatch")
    flagged = {**honest, "tau_gap": 2.5, "train_serve_mismatch": True, "mismatch_reason": "served falls short"}
    assert "train/serve mismatch[/red]: served falls short" in prediction_line(flagged)
    assert "±" not in prediction_line({**honest, "tau_gap_noise": None})


def test_the_demo_evaluates_a_few_times_during_training(tmp_path):
    cfg = DemoConfig(out_dir=tmp_path)
    train = pipeline_spec(cfg, tmp_path, tmp_path, tmp_path / "p.jsonl")["spec"]["train"]
    assert 3 <= train["steps"] // train["eval_every"] <= 8
