"""Progress of a training run in its job record (steps, loss, tokens/s, data wait, ETA), its metric points, and
stop checks."""

from __future__ import annotations

import logging
import threading

from ..components.metrics.metrics_log import EVAL_KEYS
from .train import Hooks

log = logging.getLogger(__name__)

def node_counters(nodes: dict) -> dict:
    """A trainer group's per-node figures as job counters: ``node<n>_tokens_per_s`` and the like."""
    return {f"node{n}_{k}": v for n, figures in nodes.items() for k, v in figures.items()}


def job_hooks(redis_url: str | None, job_id: str | None, stop: threading.Event | None = None,
              extra_stop=None) -> Hooks:
    """Hooks that write progress to ``job_id``'s record and stop on SIGTERM, cancel or ``extra_stop()``."""
    jobs = None
    if redis_url and job_id:
        from dfp_shared.jobs.redis_conn import connect
        from dfp_shared.jobs.store import JobStore

        jobs = JobStore(connect(redis_url))

    def progress(row: dict) -> None:
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "total_steps"}
        fields = {k: round(v, 6) if isinstance(v, float) else v for k, v in scalars.items()}
        if row.get("per_position_accuracy"):
            fields["per_position_accuracy"] = [round(a, 4) for a in row["per_position_accuracy"]]
        log.info("training progress", extra=fields)
        if jobs is None:
            return
        if "total_steps" in row:
            jobs.set_totals(job_id, steps=row["total_steps"])
        jobs.set_counters(job_id, **{("steps" if k == "step" else k): v for k, v in scalars.items()},
                          **node_counters(row.get("nodes") or {}))
        if "loss" in row:
            jobs.emit(job_id, "progress", {k: v for k, v in row.items() if k != "per_position_accuracy"})

    def counters(values: dict) -> None:
        if jobs is not None:
            jobs.set_counters(job_id, **values)

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

    return Hooks(progress=progress, counters=counters, metrics=metrics, should_stop=should_stop)
