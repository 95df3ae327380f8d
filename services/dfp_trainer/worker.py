"""The train worker: claims ``train`` tasks and runs each job's training.

A train job has one task (its ``plan`` task): the whole run. The shared worker loop keeps the task's
lease alive with heartbeats while training runs; if this worker dies, the task is redelivered and
the next worker resumes from the latest checkpoint under the job's output prefix. On SIGTERM the
run stops after its current step with a checkpoint and the task is released for another worker.
With ``nproc_per_node > 1`` the run is ``torchrun`` children (``python -m dfp_trainer.run``).
With ``nodes > 1`` this pod is one member of a trainer group (see :mod:`.group`): member 0 runs
this handler, the others :func:`follow` the group's current run.
Whoever trains a job holds its training lease, so no two groups or pods train it at once.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from dfp_shared.job_flow import finish_job
from dfp_shared.job_types import CACHE, EVALUATE, IMPORT_GGUF, TRAIN
from dfp_shared.jobs import JobState
from dfp_shared.ownership import OutputClaims
from dfp_shared.queue import Task
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage_roots import StorageRoots
from dfp_shared.worker import JobHandler, TaskCancelled, TaskContext, TaskReleased
from redis.exceptions import RedisError

from .cache_job import CacheHandler
from .evaluate.handler import EvaluateHandler
from .group import GroupRuns, TrainLease, rendezvous_args
from .import_job import ImportGGUFHandler
from .loop.data import DataError
from .loop.prepare import TrainError
from .run import run_local
from .settings import TrainerSettings, scratch_dir

log = logging.getLogger(__name__)


class TrainHandler(JobHandler):
    """``handler(task, ctx)`` of the shared worker loop for the ``train`` stream (whose ``evaluate`` jobs
    go to :class:`~.evaluate.handler.EvaluateHandler`, ``cache`` jobs to :class:`~.cache_job.CacheHandler`,
    and ``import_gguf`` jobs to :class:`~.import_job.ImportGGUFHandler`)."""

    def __init__(self, settings: TrainerSettings, redis_client):
        self.settings = settings
        self.r = redis_client
        self.roots = StorageRoots.from_settings(settings)
        self.claims = OutputClaims(self.roots, settings.s3_endpoint_url)
        self.evaluate = EvaluateHandler(settings, redis_client)
        self.cache = CacheHandler(settings, redis_client)
        self.import_gguf = ImportGGUFHandler(settings, redis_client, self.roots)

    def admit(self, task: Task, ctx: TaskContext) -> bool:
        """As every job task; a train job's hidden-state cache is claimed for its owner too, like an output."""
        if not super().admit(task, ctx):
            return False
        cache = getattr(ctx.spec, "hidden_state_cache", None)
        if ctx.job_type is TRAIN and cache is not None:
            self.claims.claim(cache, ctx.job.owner, task.job_id, field="spec.hidden_state_cache",
                              parent_id=ctx.job.parent_id)
        return True

    def handle(self, task: Task, ctx: TaskContext) -> None:
        if ctx.job_type is EVALUATE:
            self.evaluate(task, ctx)
            return
        if ctx.job_type is CACHE:
            self.cache(task, ctx)
            return
        if ctx.job_type is IMPORT_GGUF:
            self.import_gguf(task, ctx)
            return
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


def _outcome(result: dict | None, code: int, signalled: bool) -> dict:
    if result is not None:
        if "input_error" in result:  # a rank found input it cannot train on
            raise TrainError(result["input_error"])
        return result
    if signalled:
        return {"completed": False}
    raise RuntimeError(f"torchrun exited with code {code} without a result")


def group_args(settings: TrainerSettings, run_id: str) -> list[str]:
    return rendezvous_args(settings.nodes, settings.node_rank, settings.rdzv_endpoint, run_id, settings.max_restarts)


def child_env(settings: TrainerSettings) -> dict:
    """The environment of the torchrun children: this worker's settings as DFLASH_ variables, so
    flags given to the worker reach every rank."""
    env = os.environ.copy()
    for name, value in settings.model_dump().items():
        if value is not None and name != "nproc_per_node":
            env[f"DFLASH_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def launch(settings: TrainerSettings, torchrun_args: list[str], spec_json: str, job_id: str, run_args: list[str],
           should_stop) -> tuple[int, bool]:
    """Run torchrun over ``python -m dfp_trainer.run`` until it exits; returns (exit code, stop signalled)."""
    with scratch_dir(settings.work_dir, "dflash-spec-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(spec_json)
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args,
               "--nproc-per-node", str(settings.nproc_per_node), "-m", "dfp_trainer.run",
               "--spec", str(spec_path), "--job-id", job_id, *run_args]
        # its own process group: signals reach torchrun only through this worker, which turns a
        # stop into one SIGTERM (torchrun forwards it to the ranks) and an abort into a group kill
        proc = subprocess.Popen(cmd, env=child_env(settings), start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        signalled = False
        try:
            while proc.poll() is None:
                if should_stop() and not signalled:
                    proc.send_signal(signal.SIGTERM)  # torchrun forwards it; ranks checkpoint and exit
                    signalled = True
                time.sleep(0.5)
        except BaseException:  # the worker is aborted: its ranks must not outlive it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        return proc.returncode, signalled


def _die_with_parent() -> None:
    """torchrun gets SIGKILL when this worker dies (a lost pod takes its ranks with it)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def follow(settings: TrainerSettings, r, stop: threading.Event) -> None:
    """Member > 0 of a group: train every run the claimant publishes, relaunching a failed one while
    it is still the group's current run (the group re-forms); stop on ``stop``."""
    runs, roots = GroupRuns(r, settings.group_name), StorageRoots.from_settings(settings)
    done: set[str] = set()
    while not stop.is_set():
        run = runs.current()
        if run is None or run["run_id"] in done:
            stop.wait(0.5)
            continue
        if not _allowed(roots, run):
            done.add(run["run_id"])
            continue
        log.info("joining group run", extra={"job_id": run["job_id"], "run": run["run_id"]})
        run_id = run["run_id"]
        code, _ = launch(settings, group_args(settings, run_id), run["spec"], run["job_id"], ["--group-run", run_id],
                         lambda rid=run_id: stop.is_set() or _run_over(runs, rid))
        if code == 0:
            done.add(run["run_id"])
        else:
            log.warning("group run ended", extra={"job_id": run["job_id"], "run": run["run_id"], "code": code})
            stop.wait(1.0)


def _run_over(runs: GroupRuns, run_id: str) -> bool:
    """The claimant closed the run (or published another): a member still launching it, e.g. waiting at a
    rendezvous whose host has gone, stops instead of waiting out the rendezvous timeout."""
    try:
        return not runs.is_current(run_id)
    except RedisError:  # Redis away for a moment: keep going, the next poll asks again
        return False


def _allowed(roots: StorageRoots, run: dict) -> bool:
    """The claimant checked the spec; a member checks it again, since a run may come from anyone who
    can write to Redis."""
    try:
        roots.check_spec(TRAIN.name, TrainSpec.model_validate_json(run["spec"]))
    except ValueError as exc:
        log.error("group run refused", extra={"job_id": run["job_id"], "error": str(exc)})
        return False
    return True
