"""The optimiser of a run and its learning-rate schedule: AdamW for every parameter, or torch's Muon for the draft
layers' weight matrices beside AdamW for the rest (:class:`MuonAdamW`); warmup then the spec's decay
(:func:`lr_lambda`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from dfp_shared.specs.train import TrainSpec


def lr_lambda(spec: TrainSpec, total_steps: int) -> Callable[[int], float]:
    warmup = int(round(spec.warmup_ratio * total_steps))

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if spec.decay == "constant":
            return 1.0
        if spec.decay == "wsd":  # the peak held, then a linear decay over the last wsd_decay_ratio of the run
            decay_steps = max(1, int(round(spec.wsd_decay_ratio * total_steps)))
            progress = min(1.0, max(0.0, (step - (total_steps - decay_steps)) / decay_steps))
            return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * (1 - progress)
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if spec.decay == "cosine" else 1 - progress
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * shape

    return factor


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon for the 2-D weight matrices and AdamW for the rest, stepped together as one optimiser (one
    state dict for checkpoints, one LR schedule: each group keeps its own peak ``initial_lr``)."""

    def __init__(self, matrices: list[torch.nn.Parameter], others: list[torch.nn.Parameter], spec: TrainSpec):
        self.parts = [torch.optim.Muon(matrices, lr=spec.muon_lr, weight_decay=spec.weight_decay)]
        if others:
            self.parts.append(torch.optim.AdamW(others, lr=spec.lr, betas=(0.9, spec.adam_beta2), eps=1e-8,
                                                weight_decay=spec.weight_decay))
        super().__init__([*matrices, *others], {})
        self.param_groups = [g for part in self.parts for g in part.param_groups]  # what LR schedules scale

    @torch.no_grad()
    def step(self, closure=None):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        for part, saved in zip(self.parts, state_dict["parts"], strict=True):
            part.load_state_dict(saved)
        self.param_groups = [g for part in self.parts for g in part.param_groups]


MUON_MODULES = ("layers", "fc")  # the draft layers and the feature projection: hidden-to-hidden maps


def muon_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters Muon orthogonalises: the 2-D weights (both sides over 1) of the draft layers and of
    ``fc``. A family's vocabulary-sized tables (DSpark's Markov factors, DFlash2's codebooks: a row per token, each
    step's gradient on a few rows) and its one-output heads keep AdamW, as embeddings and heads do under Muon."""
    return [p for name, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and min(p.shape) > 1
            and name.split(".", 1)[0] in MUON_MODULES]


def make_optimizer(spec: TrainSpec, params: list[torch.nn.Parameter],
                   matrices: list[torch.nn.Parameter] | None = None) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter, or (``optimizer: muon``) Muon for ``matrices`` (default: every 2-D
    parameter with both sides over 1; a drafter's run passes :func:`muon_matrices`) and AdamW for the rest."""
    if spec.optimizer == "muon":
        if matrices is None:
            matrices = [p for p in params if p.ndim == 2 and min(p.shape) > 1]
        chosen = {id(p) for p in matrices}
        return MuonAdamW([p for p in params if id(p) in chosen], [p for p in params if id(p) not in chosen], spec)
    return torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, spec.adam_beta2), eps=1e-8, weight_decay=spec.weight_decay)
