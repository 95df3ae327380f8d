"""Progress of a training run in its job record (steps, loss, tokens/s, data wait, ETA), its metric points, and
stop checks."""

from __future__ import annotations

import logging
import threading

from prometheus_client import Gauge

from .metrics_log import EVAL_KEYS
from .train import Hooks

log = logging.getLogger(__name__)

GAUGES = {
    "step": Gauge("dfp_trainer_step", "Optimiser steps done in the current run"),
    "loss": Gauge("dfp_trainer_loss", "Training loss of the last step"),
    "tokens_per_s": Gauge("dfp_trainer_tokens_per_second", "Training tokens per second, all ranks"),
    "data_wait_fraction": Gauge("dfp_trainer_data_wait_fraction", "Share of step time spent waiting for data"),
    "comm_fraction": Gauge("dfp_trainer_comm_fraction", "Share of step time with gradient sync in flight"),
}


def job_hooks(redis_url: str | None, job_id: str | None, stop: threading.Event | None = None,
              extra_stop=None) -> Hooks:
    """Hooks that write progress to ``job_id``'s record and stop on SIGTERM, cancel or ``extra_stop()``."""
    jobs = None
    if redis_url and job_id:
        from dfp_shared.jobs import JobStore
        from dfp_shared.redis_conn import connect

        jobs = JobStore(connect(redis_url))

    def progress(row: dict) -> None:
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "total_steps"}
        for key, gauge in GAUGES.items():
            if key in scalars:
                gauge.set(scalars[key])
        fields = {k: round(v, 6) if isinstance(v, float) else v for k, v in scalars.items()}
        if row.get("per_position_accuracy"):
            fields["per_position_accuracy"] = [round(a, 4) for a in row["per_position_accuracy"]]
        log.info("training progress", extra=fields)
        if jobs is None:
            return
        if "total_steps" in row:
            jobs.set_totals(job_id, steps=row["total_steps"])
        jobs.set_counters(job_id, **{("steps" if k == "step" else k): v for k, v in scalars.items()})
        if "loss" in row:
            jobs.emit(job_id, "progress", {k: v for k, v in row.items() if k != "per_position_accuracy"})

    def metrics(point: dict) -> None:
        if jobs is None:
            return
        jobs.add_metrics(job_id, point)
        figures = {k: point[k] for k in EVAL_KEYS if k in point}
        if figures:  # the latest evaluation, beside the training figures in the counters
            jobs.set_counters(job_id, **figures)

    def should_stop() -> bool:
        if stop is not None and stop.is_set():
            return True
        if extra_stop is not None and extra_stop():
            return True
        return bool(jobs is not None and jobs.is_cancelled(job_id))

    return Hooks(progress=progress, metrics=metrics, should_stop=should_stop)
