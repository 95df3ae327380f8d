"""The training loop: the run's state (:mod:`.state`) stepped (:mod:`.step`) through the input pipeline
(:mod:`.inputs`), each step's figures recorded (:mod:`.figures`), checkpoints every N steps and when asked
to stop.

Read top to bottom: :meth:`Training.start` takes the run's checked inputs (:func:`.prepare.prepare`) and
builds the state (set-up, or resume from the latest checkpoint); :meth:`Training.run` trains until the
last step or a stop request; :meth:`Training.close` logs the run's final figures and waits for every rank.
What comes after a completed run (export, evaluation, report) is the caller's: :func:`dfp_trainer.run.train`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..components.data.stages import DeviceCopier, Pipeline
from ..components.distributed import DistInfo, barrier, broadcast_flag
from ..run_config import RunConfig
from .figures import StepFigures
from .inputs import input_pipeline
from .prepare import Setup, prepare
from .state import TrainState
from .step import train_micro_batch

log = logging.getLogger(__name__)


@dataclass
class Hooks:
    """Callbacks of a run: progress and metric points to the job record, and a stop request (SIGTERM or cancel)."""

    progress: Callable[[dict], None] | None = None
    counters: Callable[[dict], None] | None = None  # figures for the job record only (the hidden-state cache's)
    metrics: Callable[[dict], None] | None = None
    should_stop: Callable[[], bool] | None = None


@dataclass
class TrainResult:
    step: int
    total_steps: int
    completed: bool  # False: stopped early (checkpoint written); resume continues it
    outputs: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)


class Training:
    """One run on this rank, from its set-up to the end of the loop; a context manager that closes the
    hidden-state source it opened."""

    def __init__(self, config: RunConfig, info: DistInfo, hooks: Hooks, setup: Setup, state: TrainState,
                 owns_source: bool):
        self.config, self.info, self.hooks, self.setup, self.state = config, info, hooks, setup, state
        self.owns_source = owns_source
        self.figures: StepFigures | None = None

    @classmethod
    def start(cls, config: RunConfig, info: DistInfo, hooks: Hooks | None = None, source=None,
              setup: Setup | None = None) -> Training:
        """Check the run's inputs (unless ``setup`` is given) and build its state, resumed when it can be."""
        owns_source = source is None and setup is None
        hooks = hooks or Hooks()
        s = setup or prepare(config, info, source, counters=hooks.counters, should_stop=hooks.should_stop)
        try:
            state = TrainState.build(config, info, s)
        except BaseException:
            if owns_source:
                close_source(s.source)
            raise
        return cls(config, info, hooks, s, state, owns_source)

    def __enter__(self) -> Training:
        return self

    def __exit__(self, *exc) -> None:
        if self.owns_source:
            close_source(self.setup.source)

    @property
    def drafter(self) -> torch.nn.Module:
        return self.state.drafter

    def run(self) -> TrainResult:
        """Train from the state's step until the last one or a stop request (a checkpoint is written then)."""
        config, info, hooks, state, spec = self.config, self.info, self.hooks, self.state, self.config.spec
        self.figures = figures = StepFigures(config, self.setup, info, state, hooks)
        acc: dict = {}
        last_state, stopped = state.sampler.state_dict(), False
        pipeline = input_pipeline(config, state, self.setup, info)
        state.model.train()
        try:
            for item in pipeline:
                DeviceCopier.wait(item.event, item.batch)
                grad_norm = train_micro_batch(state, item, spec, info.world_size, acc)
                if grad_norm is None:
                    continue
                state.step, last_state = item.step + 1, item.sampler_state
                row = figures.record(acc, grad_norm, pipeline)
                acc = {}
                if state.step % spec.checkpoint_every == 0 or state.step == state.total:
                    state.save(state.step, last_state, spec, info)
                figures.progress(row)
                if state.step < state.total and broadcast_flag(bool(hooks.should_stop and hooks.should_stop()), info):
                    stopped = True
                    if state.step % spec.checkpoint_every:
                        state.save(state.step, last_state, spec, info)
                    log.info("stopping early: checkpoint written",
                             extra={"step": state.step, "total_steps": state.total})
                    break
        finally:
            pipeline.close()
            figures.live.flush()
        return TrainResult(state.step, state.total, completed=not stopped and state.step >= state.total,
                           history=state.history, summary=summarise(state.history, pipeline),
                           outputs={"checkpoints": config.output_uri("checkpoints/")})

    def close(self, result: TrainResult) -> None:
        """The run's final figures to the metrics log (from ``result.outputs``, which gets the log's
        location), its trackers closed; then every rank waits for the others."""
        self.figures.live.close(result.outputs, completed=result.completed)
        barrier(self.info)


def close_source(source) -> None:
    """Close the hidden-state source a run opened (a failure is logged: it must not hide the run's outcome)."""
    if hasattr(source, "close"):
        try:
            asyncio.run(source.close())
        except Exception as exc:  # noqa: BLE001 - closing must not hide the run's own outcome
            log.warning("closing the hidden-state source failed", extra={"error": str(exc)})


def summarise(history: list[dict], pipeline: Pipeline) -> dict:
    if not history:
        return {}
    tail = history[-max(1, len(history) // 10):]
    waited = pipeline.data_wait_fraction()
    return {"steps": history[-1]["step"], "first_loss": history[0]["loss"], "final_loss": history[-1]["loss"],
            "final_loss_avg": sum(r["loss"] for r in tail) / len(tail),
            "final_accuracy": sum(r["accuracy"] for r in tail) / len(tail),
            "tokens_per_s": sum(r["tokens_per_s"] for r in history) / len(history),
            "data_wait_fraction": waited,
            # which share of the run each side takes: the drafter's steps (the time not spent waiting on
            # data), and the target's hidden states (the fetch stage: the target's forward in process or
            # over gRPC, or reading the hidden-state cache), which runs ahead beside the steps
            "drafter_step_fraction": 1.0 - waited,
            "target_fetch_fraction": pipeline.busy_fraction("fetch"),
            "comm_fraction": sum(r["comm_fraction"] for r in history) / len(history),
            "per_position_accuracy": _mean_lists([r["per_position_accuracy"] for r in tail])}


def _mean_lists(rows: list[list[float]]) -> list[float]:
    rows = [r for r in rows if r]
    return [sum(col) / len(col) for col in zip(*rows, strict=True)] if rows else []
