"""The loss recipe of a run: its train spec's objective settings as one typed object, given to the drafter's
objective (:func:`~dfp_trainer.drafter.objective.dflash_loss`) beside the batch, the generator and the compute
settings."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class LossRecipe:
    """The training objective's settings, as one typed object (a train spec's, :meth:`from_spec`); the keyword
    arguments of :func:`~dfp_trainer.drafter.objective.dflash_loss` beside the batch, the generator and the
    compute settings."""

    max_anchors: int = 512  # anchor positions sampled per sequence
    gamma: float = 7.0  # decay of the block positions' weights, exp(-(k-1)/gamma)
    noise_std: float = 0.0  # Gaussian noise added to the target features
    loss: str = "decay"  # one of :data:`dfp_trainer.drafter.objective.LOSSES`
    dpace_alpha: float = 0.5  # smoothing of the D-PACE confidences
    confidence_weight: float = 0.0  # weight of a DSpark drafter's confidence-head BCE
    distill_weight: float = 0.0  # share of the forward KL from the target's distribution (:mod:`~dfp_trainer.drafter.distill`)
    loss_norm: str = "weights"  # the decay loss divided by its weights' sum, or by the trained positions
    anchor_spread: str = "sequence"  # max_anchors in each sequence, or max_anchors times the sequences over the batch
    label_source: str = "data"  # the data's next token, or the target's greedy one (``target_argmax``)

    @classmethod
    def from_spec(cls, spec: Any) -> LossRecipe:
        """The recipe a train spec asks for."""
        return cls(max_anchors=spec.max_anchors, gamma=spec.gamma, noise_std=spec.noise_std, loss=spec.loss,
                   dpace_alpha=spec.dpace_alpha, confidence_weight=spec.confidence_loss_weight,
                   distill_weight=spec.distill_weight, loss_norm=spec.loss_norm, anchor_spread=spec.anchor_spread,
                   label_source=spec.labels)

    def kwargs(self) -> dict[str, Any]:
        """The recipe as :func:`~dfp_trainer.drafter.objective.dflash_loss`'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
