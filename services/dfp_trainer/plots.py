"""The report's figures (PNG bytes): training loss, accuracy per block position, τ over training. They are
drawn with matplotlib, the ``plots`` extra; without it a report has no figures."""

from __future__ import annotations

import importlib.util
import io
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

MISSING = "the report has no figures: matplotlib is not installed (pip install 'dflash-pipeline[plots]')"


def _png(draw: Callable, *, xlabel: str, ylabel: str, title: str, grid: bool = True) -> bytes:
    """One 6 x 3.5 in figure: ``draw(ax)``, then the labels, title and grid; returned as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    try:
        draw(ax)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if grid:
            ax.grid(alpha=0.3)
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    return buf.getvalue()


def plot_loss(history: list[dict]) -> bytes:
    return _png(lambda ax: ax.plot([r["step"] for r in history], [r["loss"] for r in history], lw=1),
                xlabel="step", ylabel="loss", title="DFlash drafter training loss")


def plot_position_accuracy(acc: list[float]) -> bytes:
    def draw(ax) -> None:
        ax.bar(range(1, len(acc) + 1), acc)
        ax.set_ylim(0, 1)

    return _png(draw, xlabel="block position", ylabel="accuracy", title="Draft accuracy per block position",
                grid=False)


def plot_tau(points: list[dict], tau_ngram: float | None = None) -> bytes:
    """τ over training steps: measured (``tau``) and predicted from the held-out accuracies
    (``tau_predicted``) where each point has them, n-gram speculation as a horizontal line."""
    def draw(ax) -> None:
        for key, style, label in (("tau", dict(marker="o", lw=1), "measured (speculative decoding)"),
                                  ("tau_predicted", dict(marker="s", lw=1, ls="--", ms=4),
                                   "predicted (held-out accuracies)")):
            series = [(p["step"], p[key]) for p in points if p.get(key) is not None]
            if series:
                ax.plot([s for s, _ in series], [v for _, v in series], label=label, **style)
        if tau_ngram is not None:
            ax.axhline(tau_ngram, color="grey", ls=":", lw=1.5, label="n-gram speculation")
        ax.legend(fontsize=8)

    return _png(draw, xlabel="step", ylabel="tau (tokens per draft-verify step)", title="Acceptance length over training")


def report_figures(history: list[dict], per_position_accuracy: list[float], taus: list[dict],
                   tau_ngram: float | None = None) -> list[tuple[str, bytes]]:
    """The report's figures as (file name, PNG bytes): the loss, the accuracy per block position and, with
    τ points, τ over training; none, with a warning, where matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        log.warning(MISSING)
        return []
    figures = [("loss_curve.png", plot_loss(history)),
               ("position_accuracy.png", plot_position_accuracy(per_position_accuracy))]
    if taus:
        figures.append(("tau_curve.png", plot_tau(taus, tau_ngram)))
    return figures
