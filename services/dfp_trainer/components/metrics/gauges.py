"""The trainer's Prometheus gauges: each node's latest training figures, for any number of processes.

A lone process sets them in the worker itself. With torchrun children (``nproc_per_node > 1`` or a
trainer group), the node's local rank 0 sets them in prometheus_client's multiprocess mode: the
worker gives its children a ``PROMETHEUS_MULTIPROC_DIR`` and serves what they write there through
:class:`prometheus_client.multiprocess.MultiProcessCollector`, in place of its own (unset) gauges.
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY, Gauge

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

GAUGES = {
    "step": Gauge("dfp_trainer_step", "Optimiser steps done in the current run", multiprocess_mode="mostrecent"),
    "loss": Gauge("dfp_trainer_loss", "Training loss of the last step", multiprocess_mode="mostrecent"),
    "tokens_per_s": Gauge("dfp_trainer_tokens_per_second", "Training tokens per second of this node's ranks",
                          multiprocess_mode="mostrecent"),
    "data_wait_fraction": Gauge("dfp_trainer_data_wait_fraction", "Share of step time this node's ranks spent "
                                "waiting for data", multiprocess_mode="mostrecent"),
    "comm_fraction": Gauge("dfp_trainer_comm_fraction", "Share of step time this node's ranks had gradient sync "
                           "in flight", multiprocess_mode="mostrecent"),
}


def set_node_gauges(figures: dict, step: int, loss: float) -> None:
    """This node's figures of a step (``tokens_per_s``, ``data_wait_fraction``, ``comm_fraction``)."""
    GAUGES["step"].set(step)
    GAUGES["loss"].set(loss)
    for key in ("tokens_per_s", "data_wait_fraction", "comm_fraction"):
        if key in figures:
            GAUGES[key].set(figures[key])


def serve_children_gauges(directory: str | Path) -> Path:
    """Serve, from this worker's registry, the gauges its torchrun children write under ``directory``."""
    from prometheus_client.multiprocess import MultiProcessCollector

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for gauge in GAUGES.values():
        REGISTRY.unregister(gauge)
    MultiProcessCollector(REGISTRY, path=str(path))
    return path
