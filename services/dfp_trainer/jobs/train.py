"""The ``train`` job: one task (its ``plan`` task) is the whole run.

The shared worker loop keeps the task's lease alive with heartbeats while training runs; if this worker dies, the
task is redelivered and the next worker resumes from the latest checkpoint under the job's output prefix. On
SIGTERM the run stops after its current step with a checkpoint and the task is released for another worker.
With ``nproc_per_node > 1`` the run is ``torchrun`` children (:mod:`.launch`). With ``nodes > 1`` this pod is one
member of a trainer group (see :mod:`..group`): member 0 runs this handler, the others
:func:`~.launch.follow` the group's current run. Whoever trains a job holds its training lease, so no two groups
or pods train it at once.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import time
from pathlib import Path

from dfp_shared.hidden_states import CacheError
from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.queue import Task
from dfp_shared.jobs.store import JobState
from dfp_shared.jobs.worker import TaskCancelled, TaskContext, TaskReleased
from dfp_shared.specs.train import TrainSpec

from ..components.data.dataset import DataError
from ..group import GroupRuns, TrainLease
from ..loop.prepare import TrainError
from ..run import run_local
from ..settings import scratch_dir
from .base import JobRunner
from .launch import _outcome, group_args, launch

log = logging.getLogger(__name__)


class TrainJob(JobRunner):
    """Runs an admitted task of a train job."""

    def __call__(self, task: Task, ctx: TaskContext) -> None:
        spec: TrainSpec = ctx.spec
        lease = TrainLease(self.r, task.job_id, self._owner(), self.settings.lease_ms)
        holder = lease.acquire()
        if holder is not None:  # another group or pod trains it now (it took over a stalled lease)
            log.warning("job is being trained elsewhere", extra={"job_id": task.job_id, "holder": holder})
            time.sleep(self.settings.lease_ms / 3000)
            raise TaskReleased(task.job_id)
        log.info("training job claimed", extra={"job_id": task.job_id, "deliveries": task.deliveries})
        try:
            with lease:
                result = self._train(spec, task, ctx)
        except (TrainError, DataError, CacheError) as exc:  # bad input: retrying cannot help
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

    def _owner(self) -> str:
        """Who holds the training lease: the group by its name, a lone pod by its consumer name."""
        if self.settings.nodes > 1:
            return f"group:{self.settings.group_name}"
        return f"pod:{socket.gethostname()}-{os.getpid()}"

    def _train(self, spec: TrainSpec, task: Task, ctx: TaskContext) -> dict:
        if self.settings.nodes > 1:
            return self._group_run(spec, task, ctx)
        if self.settings.nproc_per_node > 1:
            return self._torchrun(spec, task, ctx)
        result = run_local(spec, self.settings, job_id=task.job_id, extra_stop=ctx.stopping.is_set)
        return {"completed": result.completed, "outputs": result.outputs, "summary": result.summary,
                "step": result.step}

    def _torchrun(self, spec: TrainSpec, task: Task, ctx: TaskContext) -> dict:
        with scratch_dir(self.settings.work_dir, "dflash-train-") as tmp:
            result_path = Path(tmp) / "result.json"
            extra = shlex.split(self.settings.torchrun_args) or ["--standalone"]
            code, signalled = launch(self.settings, extra, spec.model_dump_json(), task.job_id,
                                     ["--result", str(result_path)], lambda: ctx.stopping.is_set() or ctx.cancelled())
            result = json.loads(result_path.read_text()) if result_path.exists() else None
            return _outcome(result, code, signalled)

    def _group_run(self, spec: TrainSpec, task: Task, ctx: TaskContext) -> dict:
        """Publish the job to the group, train it as one member, and read rank 0's result."""
        runs = GroupRuns(self.r, self.settings.group_name)
        run_id = f"{task.job_id}-{task.deliveries}"  # a redelivery meets at a fresh rendezvous
        runs.publish(run_id, task.job_id, spec.model_dump_json())
        try:
            code, signalled = launch(self.settings, group_args(self.settings, run_id), spec.model_dump_json(),
                                     task.job_id, ["--group-run", run_id],
                                     lambda: ctx.stopping.is_set() or ctx.cancelled())
            return _outcome(runs.result(run_id), code, signalled)
        finally:
            runs.close(run_id)
