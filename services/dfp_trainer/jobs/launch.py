"""torchrun launching and the trainer group's follow loop: a train job's run as ``torchrun`` children
(``python -m dfp_trainer.run``, one per rank), and member > 0 of a trainer group (see :mod:`..group`) following
the group's current run.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from dfp_shared.jobs.store import JobNotFound, JobStore
from dfp_shared.jobs.types import TRAIN
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import AccessRefused
from redis.exceptions import RedisError

from ..group import GroupRuns, rendezvous_args
from ..loop.prepare import TrainError
from ..settings import TrainerSettings, scratch_dir

log = logging.getLogger(__name__)


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
        if not _allowed(roots, run, r):
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


def _allowed(roots: StorageRoots, run: dict, r) -> bool:
    """The claimant checked the spec; a member checks it again, roots and the reservations of the job's owner,
    since a run may come from anyone who can write to Redis."""
    try:
        spec = TrainSpec.model_validate_json(run["spec"])
        roots.check_spec(TRAIN.name, spec)
        roots.check_reservations(TRAIN.name, spec, JobStore(r).get(run["job_id"]).owner)
    except (ValueError, AccessRefused, JobNotFound) as exc:  # a spec outside the roots too: refused, not raised
        log.error("group run refused", extra={"job_id": run["job_id"], "error": str(exc)})
        return False
    return True
