"""The report's predicted τ, train/serve verdict, τ curve and headline, from numbers fed to its builders."""

from __future__ import annotations

import logging
import sys

import pytest
from dfp_trainer.plots import plot_tau, report_figures
from dfp_trainer.report import headline, predictions, tau_points

PNG = b"\x89PNG\r\n\x1a\n"


def _evaluation(trained_steps: list[int]) -> dict:
    """8 prompts of 31 tokens; the trained drafter's held-out accuracies predict about 3.5 tokens a step."""
    tokens = [31] * 8

    def measured(steps):
        return {"tau": sum(tokens) / sum(steps), "per_prompt": [t / s for t, s in zip(tokens, steps)],
                "per_prompt_steps": steps, "per_prompt_new_tokens": tokens}

    return {"tau_trained": measured(trained_steps)["tau"], "tau_untrained": 1.0, "tau_ngram": 1.4,
            "eval_trained": measured(trained_steps), "eval_untrained": measured([31] * 8),
            "heldout_trained": {"per_position_accuracy": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3],
                                "per_position_count": [300.0] * 7},
            "heldout_untrained": {"per_position_accuracy": [0.0] * 7, "per_position_count": [300.0] * 7}}


def test_a_drafter_measured_far_below_its_prediction_is_a_train_serve_mismatch():
    evaluation = _evaluation([28, 30, 29, 31, 27, 30, 29, 28])  # about 1.07 tokens a step served
    pred = predictions(evaluation)
    assert pred["tau_predicted_untrained"] == 1.0
    assert pred["tau_predicted"] > 2.5 and pred["tau_gap"] == pytest.approx(pred["tau_predicted"] - evaluation["tau_trained"])
    assert pred["train_serve_mismatch"] is True and pred["tau_gap"] > pred["tau_gap_noise"] > 0
    assert "falls short" in pred["mismatch_reason"]
    out = headline({}, {**evaluation, **pred})
    assert out["tau_predicted"] == pred["tau_predicted"] and out["train_serve_mismatch"] is True
    assert out["tau_gap"] == pred["tau_gap"] and out["tau_gap_noise"] == pred["tau_gap_noise"]
    assert out["mismatch_reason"] == pred["mismatch_reason"]


def test_a_drafter_measured_as_predicted_is_not_flagged():
    evaluation = _evaluation([8, 10, 9, 11, 9, 8, 10, 9])  # about 3.4 tokens a step served
    pred = predictions(evaluation)
    assert abs(pred["tau_gap"]) < pred["tau_gap_noise"] and pred["train_serve_mismatch"] is False
    assert headline({}, {**evaluation, **pred})["train_serve_mismatch"] is False


def test_the_tau_curve_has_measured_and_predicted_points_and_draws_the_ngram_line():
    evaluation = _evaluation([8, 10, 9, 11, 9, 8, 10, 9])
    evaluation.update(predictions(evaluation))
    history = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0, "tau_predicted": 1.5},  # a remote target: no tau
               {"step": 3, "loss": 1.5}, {"step": 4, "loss": 1.2, "tau": 2.0, "tau_predicted": 2.2}, {"step": 5}]
    points = tau_points(history, evaluation)
    assert [p["step"] for p in points] == [0, 2, 4, 5]
    assert points[0] == {"step": 0, "tau": 1.0, "tau_predicted": 1.0}
    assert points[1] == {"step": 2, "tau_predicted": 1.5}
    assert points[-1] == {"step": 5, "tau": evaluation["tau_trained"], "tau_predicted": evaluation["tau_predicted"]}
    assert plot_tau(points, evaluation["tau_ngram"])[:8] == PNG
    assert plot_tau([{"step": 0, "tau_predicted": 1.0}])[:8] == PNG


def test_the_report_s_figures_and_none_without_matplotlib(monkeypatch, caplog):
    """matplotlib is the ``plots`` extra: an installation without it trains and reports, without figures."""
    history = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    taus = [{"step": 0, "tau": 1.0}, {"step": 2, "tau": 1.5, "tau_predicted": 1.6}]
    figures = report_figures(history, [0.5, 0.25], taus, 1.2)
    assert [name for name, _ in figures] == ["loss_curve.png", "position_accuracy.png", "tau_curve.png"]
    assert all(png[:8] == PNG for _, png in figures)
    assert [name for name, _ in report_figures(history, [0.5], [])] == ["loss_curve.png", "position_accuracy.png"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.WARNING, logger="dfp_trainer.plots"):
        assert report_figures(history, [0.5], taus) == []
    assert "matplotlib is not installed (pip install 'dflash-pipeline[plots]')" in caplog.text

