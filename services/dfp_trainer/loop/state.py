"""The training state of a run, built once: the drafter wrapped for DDP, the optimiser and its LR schedule,
the batch sampler, the checkpoints, the step and the history; from scratch or resumed from the run's latest
checkpoint (weights, optimiser, schedule, sampler position, RNG state, history: a resumed run continues bit
for bit as if never stopped).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.store import open_store

from ..components.checkpoint import CheckpointError, CheckpointManager, rng_state, set_rng_state
from ..components.data.dataset import BatchSampler
from ..components.distributed import CommTimer, DistInfo, barrier, wrap_model
from ..components.optimizer import lr_lambda, make_optimizer, muon_matrices
from ..drafter.wrappers import unwrap
from ..run_config import RunConfig
from .prepare import Setup, TrainError

log = logging.getLogger(__name__)


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
        optim = make_optimizer(spec, params, muon_matrices(unwrap(model)))
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
