"""The training state of a run, built once: the drafter wrapped for DDP, the optimiser and its LR schedule,
the batch sampler, the checkpoints, the step and the history; from scratch or resumed from the run's latest
checkpoint (weights, optimiser, schedule, sampler position, RNG state, history: a resumed run continues bit
for bit as if never stopped).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage import open_store

from ..drafter.wrappers import unwrap
from ..run_config import RunConfig
from .checkpoint import CheckpointError, CheckpointManager, rng_state, set_rng_state
from .data import BatchSampler
from .distributed import CommTimer, DistInfo, barrier, wrap_model
from .prepare import Setup, TrainError

log = logging.getLogger(__name__)


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


def make_optimizer(spec: TrainSpec, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter, or (``optimizer: muon``) Muon for the matrices and AdamW for the rest."""
    if spec.optimizer == "muon":
        matrices = [p for p in params if p.ndim == 2]
        return MuonAdamW(matrices, [p for p in params if p.ndim != 2], spec)
    return torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, spec.adam_beta2), eps=1e-8, weight_decay=spec.weight_decay)


@dataclass
class TrainState:
    """What the loop changes step by step, and what a checkpoint holds of it."""

    model: torch.nn.Module  # the drafter, DDP-wrapped when distributed
    comm: CommTimer | None  # gradient-sync timing (DDP only)
    params: list[torch.nn.Parameter]  # the trainable ones
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    sampler: BatchSampler
    ckpts: CheckpointManager
    total: int  # steps of the whole run
    step: int = 0  # optimiser steps done
    history: list[dict] = field(default_factory=list)  # one row per step

    @property
    def drafter(self) -> torch.nn.Module:
        return unwrap(self.model)

    @classmethod
    def build(cls, config: RunConfig, info: DistInfo, s: Setup) -> TrainState:
        """Set up the run's state; with ``config.resume``, continue from its latest checkpoint if there is one."""
        spec, world, accum = config.spec, info.world_size, config.spec.grad_accum
        lengths = s.dataset.lengths.clamp(max=spec.max_length)
        keep = torch.zeros(s.dataset.num_samples, dtype=torch.bool)
        keep[s.train_pool] = True
        sampler = BatchSampler(lengths, spec.tokens_per_batch, seed=spec.seed, divisor=world * accum, eligible=keep)
        total = spec.steps or max(1, math.ceil(spec.epochs * sampler.batches_per_epoch()))

        model, comm = wrap_model(s.drafter, info)
        params = unwrap(model).trainable_parameters()
        optim = make_optimizer(spec, params)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(spec, total))
        ckpts = CheckpointManager(open_store(config.output_uri("checkpoints"),
                                             endpoint_url=config.settings.s3_endpoint_url), keep=spec.keep_checkpoints)
        state = cls(model, comm, params, optim, sched, sampler, ckpts, total)
        state.resume(config)
        return state

    def resume(self, config: RunConfig) -> None:
        try:
            pointer = self.ckpts.latest() if config.resume else None
        except CheckpointError as exc:
            raise TrainError(str(exc)) from None
        if pointer is None:
            return
        try:
            saved = self.ckpts.load(self.drafter, pointer)
            self.optim.load_state_dict(saved["optimizer"])
            self.sched.load_state_dict(saved["scheduler"])
            self.sampler.load_state_dict(saved["sampler"])
            set_rng_state(saved["rng"])
            self.step, self.history = int(saved["step"]), list(saved.get("history", []))
        except (CheckpointError, KeyError, TypeError, ValueError) as exc:  # a checkpoint this run cannot resume from
            raise TrainError(f"checkpoint under {config.output_uri('checkpoints/')}: {exc}") from None
        log.info("resumed", extra={"step": self.step, "total_steps": self.total})

    def save(self, at_step: int, sampler_state: dict, spec: TrainSpec, info: DistInfo) -> None:
        """Checkpoint ``at_step`` (rank 0 writes it, every rank waits for it); ``sampler_state`` resumes right
        after that step's batch."""
        if info.is_main:
            extra: dict[str, Any] = {
                "optimizer": self.optim.state_dict(), "scheduler": self.sched.state_dict(), "sampler": sampler_state,
                "rng": rng_state(), "history": self.history, "spec": spec.model_dump(mode="json"),
                "world_size": info.world_size}
            self.ckpts.save(at_step, self.drafter, extra)
        barrier(info)
