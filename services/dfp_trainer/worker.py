"""The train worker: claims ``train`` tasks and runs each job's training.

A train job has one task (its ``plan`` task): the whole run. The shared worker loop keeps the task's
lease alive with heartbeats while training runs; if this worker dies, the task is redelivered and
the next worker resumes from the latest checkpoint under the job's output prefix. On SIGTERM the
run stops after its current step with a checkpoint and the task is released for another worker.
With ``nproc_per_node > 1`` the run is ``torchrun`` children (``python -m dfp_trainer.run``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from dfp_shared.jobs import JobState
from dfp_shared.ownership import OutputClaims
from dfp_shared.queue import Task
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage_roots import StorageRoots
from dfp_shared.submit import finish_job
from dfp_shared.worker import TaskCancelled, TaskContext, TaskReleased

from .data import DataError
from .prepare import TrainError
from .run import run_local
from .settings import TrainerSettings, scratch_dir

log = logging.getLogger(__name__)


class TrainHandler:
    """``handler(task, ctx)`` of the shared worker loop for the ``train`` stream."""

    def __init__(self, settings: TrainerSettings, redis_client):
        self.settings = settings
        self.r = redis_client
        self.roots = StorageRoots.from_settings(settings)
        self.claims = OutputClaims(self.roots, settings.s3_endpoint_url)

    def __call__(self, task: Task, ctx: TaskContext) -> None:
        job = ctx.jobs.get(task.job_id)
        try:
            spec = TrainSpec.model_validate(job.spec)
        except ValueError as exc:
            finish_job(self.r, task.job_id, JobState.failed, error=f"invalid train spec: {exc}")
            return
        # before any I/O (resume reads the output prefix): the task may come from anyone who can write to Redis
        self.roots.check_spec("train", spec)
        self.claims.claim(spec.output, job.owner, task.job_id, parent_id=job.parent_id)
        log.info("training job claimed", extra={"job_id": task.job_id, "deliveries": task.deliveries})
        try:
            if self.settings.nproc_per_node > 1:
                result = self._torchrun(spec, task, ctx)
            else:
                result = run_local(spec, self.settings, job_id=task.job_id, extra_stop=ctx.stopping.is_set)
                result = {"completed": result.completed, "outputs": result.outputs, "summary": result.summary,
                          "step": result.step}
        except (TrainError, DataError) as exc:  # bad input: retrying cannot help
            log.error("training cannot start", extra={"job_id": task.job_id, "error": str(exc)})
            finish_job(self.r, task.job_id, JobState.failed, error=str(exc))
            return
        if ctx.cancelled():
            raise TaskCancelled(task.job_id)
        if not result.get("completed"):
            raise TaskReleased(task.job_id)  # stopped at a checkpoint: the next worker resumes
        ctx.jobs.complete_task(task.job_id, task.key)
        outputs = {k: v for k, v in result["outputs"].items() if v is not None}
        finish_job(self.r, task.job_id, JobState.succeeded, outputs=outputs)

    def _child_env(self) -> dict:
        """The environment of the torchrun children: this worker's settings as DFLASH_ variables, so
        flags given to the worker reach every rank."""
        env = os.environ.copy()
        for name, value in self.settings.model_dump().items():
            if value is not None and name != "nproc_per_node":
                env[f"DFLASH_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        return env

    def _torchrun(self, spec: TrainSpec, task: Task, ctx: TaskContext) -> dict:
        with scratch_dir(self.settings.work_dir, "dflash-train-") as tmp:
            spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
            spec_path.write_text(spec.model_dump_json())
            extra = shlex.split(self.settings.torchrun_args) or ["--standalone"]
            cmd = [sys.executable, "-m", "torch.distributed.run", *extra,
                   "--nproc-per-node", str(self.settings.nproc_per_node), "-m", "dfp_trainer.run",
                   "--spec", str(spec_path), "--job-id", task.job_id, "--result", str(result_path)]
            # its own process group: signals reach torchrun only through this worker, which turns a
            # stop into one SIGTERM (torchrun forwards it to the ranks) and an abort into a group kill
            proc = subprocess.Popen(cmd, env=self._child_env(), start_new_session=True)
            signalled = False
            try:
                while proc.poll() is None:
                    if (ctx.stopping.is_set() or ctx.cancelled()) and not signalled:
                        proc.send_signal(signal.SIGTERM)  # torchrun forwards it; ranks checkpoint and exit
                        signalled = True
                    time.sleep(0.5)
            except BaseException:  # the worker is aborted: its ranks must not outlive it
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            if result_path.exists():
                result = json.loads(result_path.read_text())
                if "input_error" in result:  # a rank found input it cannot train on
                    raise TrainError(result["input_error"])
                return result
            if signalled:
                return {"completed": False}
            raise RuntimeError(f"torchrun exited with code {proc.returncode} without a result")
