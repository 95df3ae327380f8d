"""A step's numbers turned into the run's figures, in one place: the history row (reduced over ranks:
loss, accuracy, LR, gradient norm, throughput, data-wait and communication shares, accuracy per block
position, per-node figures of a trainer group), this node's Prometheus gauges, the live metrics log
(:mod:`..components.metrics.metrics_log`, with its mid-training evaluations) and the job's progress."""

from __future__ import annotations

import time

import torch

from ..components.data.stages import Pipeline, WaitMeter
from ..components.distributed import DistInfo, node_figures, reduce_metrics
from ..components.metrics.gauges import set_node_gauges
from ..components.metrics.metrics_log import MetricsLog
from ..run_config import RunConfig
from .prepare import Setup
from .state import TrainState


class StepFigures:
    """Built when the loop starts (the starting step goes to the progress); :meth:`record` after each
    optimiser step, :meth:`progress` once its checkpoint (if due) is written."""

    def __init__(self, config: RunConfig, s: Setup, info: DistInfo, state: TrainState, hooks):
        self.config, self.info, self.state, self.hooks = config, info, state, hooks
        if hooks.progress and info.is_main:  # where the run starts: step 0, or the step it resumed at
            hooks.progress({"step": state.step, "total_steps": state.total})
        self.meter = WaitMeter()
        self.wait_mark = 0.0
        self.last_report = self.last_end = self.now = time.perf_counter()
        self.live = MetricsLog(config, s, info, state.total, sink=hooks.metrics)

    def record(self, acc: dict, grad_norm: torch.Tensor, pipeline: Pipeline) -> dict:
        """The history row of the step just taken (``acc``: its sums on this rank); sets the gauges,
        appends the row to the history and logs it (and a mid-training evaluation when due)."""
        info, state = self.info, self.state
        now = time.perf_counter()
        step_s, self.last_end, self.now = now - self.last_end, now, now
        waited, self.wait_mark = pipeline.wait_s - self.wait_mark, pipeline.wait_s
        self.meter.add(waited, step_s)
        comm_s = state.comm.take() if state.comm is not None else 0.0
        m = reduce_metrics({**{k: v for k, v in acc.items() if not isinstance(v, list)},
                            "grad_norm": float(grad_norm), "data_wait_s": waited, "comm_s": comm_s}, info)
        tokens = m["tokens"] * info.world_size
        row = {"step": state.step, "loss": m["loss_sum"] / max(m["weight_sum"], 1e-12),
               "accuracy": m["correct_sum"] / max(m["count_sum"], 1e-12), "lr": state.sched.get_last_lr()[0],
               "grad_norm": m["grad_norm"], "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
               "data_wait_fraction": self.meter.fraction(),
               "comm_fraction": m["comm_s"] / step_s if step_s else 0.0,
               "per_position_accuracy": position_accuracy(acc, info)}
        nodes = node_figures(info, acc["tokens"], step_s, waited, comm_s) if info.distributed else {}
        if info.local_rank == 0:  # this node's figures on its trainer's Prometheus gauges
            set_node_gauges(nodes.get(info.node) or row, state.step, row["loss"])
        if len(nodes) > 1:
            row["nodes"] = {str(n): figures for n, figures in nodes.items()}
        state.history.append(row)
        self.live.step(row, state.drafter)
        return row

    def progress(self, row: dict) -> None:
        """``row`` to the job's progress (rank 0), every ``progress_every_s`` seconds and at the last step."""
        step, total = self.state.step, self.state.total
        if not (self.hooks.progress and self.info.is_main):
            return
        if self.now - self.last_report >= self.config.settings.progress_every_s or step == total:
            self.last_report = self.now
            self.hooks.progress({**row, "total_steps": total})


def position_accuracy(acc: dict, info: DistInfo) -> list[float]:
    """Accuracy per block position of the step (summed over ranks)."""
    correct, count = acc.get("per_position_correct", []), acc.get("per_position_count", [])
    if info.distributed and correct:
        both = reduce_metrics({f"c{i}": v for i, v in enumerate(correct)} |
                              {f"n{i}": v for i, v in enumerate(count)}, info, op="sum")
        correct = [both[f"c{i}"] for i in range(len(correct))]
        count = [both[f"n{i}"] for i in range(len(count))]
    return [c / n if n else 0.0 for c, n in zip(correct, count, strict=True)]
