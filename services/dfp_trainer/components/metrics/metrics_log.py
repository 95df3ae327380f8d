"""Live training metrics: a point every ``log_every`` steps, and a mid-training evaluation every
``eval_every`` steps, to TensorBoard event files, an MLflow server and the job's metric history.

A point holds the step's training figures (loss, accuracy and accuracy per block position, learning
rate, grad norm, tokens/s, data-wait and sync shares) and, at an evaluation step, ``heldout_loss``,
``heldout_accuracy``, ``tau_predicted`` (the τ the held-out per-position accuracies predict by the
product rule, :mod:`dfp_trainer.evaluate.prediction`, counted as the measured τ: cut where each prompt's
decode ended, or at the whole budget without a measured one) and, with the target in-process, ``tau``
(acceptance length by real speculative decoding; a remote target's τ is measured at the end only, so
the trainer never holds a second copy of a large target while it trains) on at most
:data:`MID_EVAL_SAMPLES` held-out samples, whose target features are fetched once before training.

* **TensorBoard**: event files are written to a local scratch directory and uploaded through the
  storage layer to ``<output>/tensorboard/`` (``file://`` or ``s3://``) every
  ``metrics_upload_every_s`` seconds and at the end. A resumed run adds an event file of its own.
* **MLflow**: when the operator sets ``DFLASH_MLFLOW_TRACKING_URI`` (a setting, never the spec), one
  run per output prefix (tag ``dflash.output``; a resume continues it) in ``DFLASH_MLFLOW_EXPERIMENT``.
* **The job**: each point goes to ``sink`` (the job record's metric history and its event stream).

Only the main rank writes; at an evaluation step every rank waits for it. A tracker that fails is
logged and dropped, never the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from dfp_shared.storage.store import open_store

from ...evaluate.prediction import predicted_tau_cut
from ...evaluate.prompts import eval_prompts
from ...evaluate.tau import tau_of
from ...run_config import RunConfig
from ...settings import scratch_dir
from ..distributed import DistInfo, barrier
from .heldout import heldout_batches, heldout_metrics

log = logging.getLogger(__name__)

MID_EVAL_SAMPLES = 4
"""Held-out samples (and prompts) of a mid-training evaluation: bounded, so it costs a few steps."""

TRAIN_KEYS = ("loss", "accuracy", "lr", "grad_norm", "tokens_per_s", "data_wait_fraction", "comm_fraction")
EVAL_KEYS = ("heldout_loss", "heldout_accuracy", "tau", "tau_predicted")
FINAL_KEYS = {"heldout_loss": "heldout_loss", "heldout_accuracy": "heldout_accuracy", "tau": "tau_trained",
              "tau_predicted": "tau_predicted"}


def point_of(row: dict) -> dict:
    """The flat point of a history row: ``step``, the training figures, ``accuracy_pos_<k>`` per block
    position k (1..B-1) and the evaluation figures when the row has them."""
    point = {"step": int(row["step"]), **{k: float(row[k]) for k in TRAIN_KEYS + EVAL_KEYS if k in row}}
    for k, acc in enumerate(row.get("per_position_accuracy") or [], start=1):
        point[f"accuracy_pos_{k}"] = float(acc)
    return point


def tag_of(key: str) -> str:
    """The tracker tag of a point's key: ``eval/...`` for evaluation figures, ``train/...`` for the rest."""
    return ("eval/" if key in EVAL_KEYS else "train/") + key


class _TensorBoard:
    def __init__(self, config: RunConfig):
        from torch.utils.tensorboard import SummaryWriter

        self._tmp = scratch_dir(config.settings.work_dir, "dflash-tensorboard-")
        self.dir = Path(self._tmp.name)
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.store = open_store(config.output_uri("tensorboard"), endpoint_url=config.settings.s3_endpoint_url)
        self.every_s, self.uploaded = config.settings.metrics_upload_every_s, float("-inf")

    def write(self, point: dict) -> None:
        for key, value in point.items():
            if key != "step":
                self.writer.add_scalar(tag_of(key), value, point["step"])
        if time.monotonic() - self.uploaded >= self.every_s:
            self.upload()

    def upload(self) -> None:
        self.writer.flush()
        files = [p for p in self.dir.rglob("*") if p.is_file()]
        self.store.put_many([(p.relative_to(self.dir).as_posix(), p.read_bytes()) for p in files])
        self.uploaded = time.monotonic()

    def close(self, status: str) -> None:
        self.upload()
        self.writer.close()
        self._tmp.cleanup()


class _Mlflow:
    def __init__(self, config: RunConfig):
        from mlflow.tracking import MlflowClient

        settings, output = config.settings, config.spec.output
        self.client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
        experiment = self.client.get_experiment_by_name(settings.mlflow_experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(settings.mlflow_experiment))
        quoted = output.replace("'", "\\'")
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.`dflash.output` = '{quoted}'",
                                       max_results=1)
        if runs:
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(experiment_id, run_name=output.rstrip("/").rsplit("/", 1)[-1],
                                         tags={"dflash.output": output})
            self.run_id = run.info.run_id
            spec = config.spec.model_dump(mode="json")
            self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in spec.items() if v is not None])

    def write(self, point: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag_of(k), v, now, point["step"])
                                                    for k, v in point.items() if k != "step"])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def _param(key: str, value) -> object:
    from mlflow.entities import Param

    return Param(key, str(value)[:500])


class MetricsLog:
    """The run's live metrics (see the module docstring); ``step`` after each optimiser step, ``flush``
    when the loop ends, ``close`` with the run's outputs."""

    def __init__(self, config: RunConfig, setup, info: DistInfo, total_steps: int,
                 sink: Callable[[dict], None] | None = None):
        self.spec, self.setup, self.info, self.total = config.spec, setup, info, total_steps
        self.sink = sink if info.is_main else None
        self.tb_uri = config.output_uri("tensorboard/")
        self.eval_every = self.spec.eval_every if config.evaluate and setup.eval_index.numel() else None
        self.trackers: list = []
        self._heldout: list | None = None
        self._last = None
        if not info.is_main:
            return
        self.trackers.append(_TensorBoard(config))
        if config.settings.mlflow_tracking_uri:
            self._open(_Mlflow, config)
        if self.eval_every:  # before the input pipeline starts: the features come from the same source
            self._heldout = list(heldout_batches(self.setup, torch.device("cpu"), limit=MID_EVAL_SAMPLES))

    def _open(self, tracker, config: RunConfig) -> None:
        try:
            self.trackers.append(tracker(config))
        except Exception as exc:  # noqa: BLE001 - a tracker that is down must not stop training
            log.warning("metrics tracker unavailable", extra={"tracker": tracker.__name__, "error": str(exc)})

    def step(self, row: dict, drafter: torch.nn.Module) -> None:
        """Log ``row`` (a history row) when due; at an evaluation step first add the evaluation to it."""
        step = int(row["step"])
        evaluate = bool(self.eval_every) and step % self.eval_every == 0 and step < self.total
        if evaluate:
            if self.info.is_main:
                row.update(self._evaluate(drafter))
            barrier(self.info)
        if self.info.is_main and (evaluate or step % self.spec.log_every == 0 or step == self.total):
            self._write(point_of(row))

    def _evaluate(self, drafter: torch.nn.Module) -> dict:
        device = next(drafter.parameters()).device
        held = heldout_metrics(drafter, (b.to(device) for b in self._heldout), max_anchors=self.spec.max_anchors,
                               gamma=self.spec.gamma, seed=self.spec.seed)
        out = {"heldout_loss": held["loss"], "heldout_accuracy": held["accuracy"]}
        prompts = eval_prompts(self.setup)[:MID_EVAL_SAMPLES]
        target = getattr(self.setup.source, "model", None)  # a remote target is not loaded here mid-training
        lengths = [self.spec.eval_max_new_tokens - 1]  # the whole budget: what a decode emits without a stop
        if prompts and target is not None:
            measured = tau_of(self.setup, drafter, target, prompts)
            out["tau"] = measured["tau"]
            lengths = [p["new_tokens"] for p in measured["per_prompt"]]
        out["tau_predicted"] = predicted_tau_cut(held["per_position_accuracy"], lengths)
        return out

    def _write(self, point: dict, whole: dict | None = None) -> None:
        """``point`` to the trackers, and ``whole`` (the step's point with it; default ``point``) to the sink."""
        self._last = whole or point
        for tracker in list(self.trackers):
            try:
                tracker.write(point)
            except Exception as exc:  # noqa: BLE001 - dropped, the run goes on
                log.warning("metrics tracker failed; dropped", extra={"error": str(exc)})
                self.trackers.remove(tracker)
        if self.sink is not None:
            self.sink(self._last)

    def flush(self) -> None:
        """Upload the event files written so far (the loop ended: finished, stopped or failed)."""
        for tracker in self.trackers:
            if isinstance(tracker, _TensorBoard):
                self._safely(tracker.upload)

    def close(self, outputs: dict | None = None, completed: bool = True) -> None:
        """Log the final evaluation (``outputs``' held-out loss and accuracy, trained and predicted τ) at the last step,
        upload the event files, end the MLflow run, and name the event files' prefix in ``outputs``."""
        if outputs is not None and self.info.is_main:
            outputs["tensorboard"] = self.tb_uri
        final = {k: float(outputs[v]) for k, v in FINAL_KEYS.items() if outputs and outputs.get(v) is not None}
        if final and self.info.is_main:
            last = self._last if self._last and self._last["step"] == self.total else {"step": self.total}
            self._write({"step": self.total, **final}, {**last, **final})
        for tracker in self.trackers:
            self._safely(tracker.close, "FINISHED" if completed else "KILLED")
        self.trackers = []

    @staticmethod
    def _safely(fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the run's outcome stands
            log.warning("metrics tracker failed at the end", extra={"error": str(exc)})
