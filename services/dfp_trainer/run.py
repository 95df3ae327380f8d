"""``python -m dfp_trainer.run``: one training process (what ``torchrun`` launches per rank).

Reads the job spec from a JSON file, joins the process group torchrun describes, trains, and on
rank 0 reports progress to the job record (when ``--job-id`` is given) and writes the result JSON
to ``--result``. SIGTERM stops after the current step with a checkpoint (exit code 3); the next run
resumes from it. Input the run cannot train on (dataset, target, settings) ends it with exit code 2
and, on rank 0, ``{"input_error": ...}`` as the result, so the worker fails the job without retrying.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import click
from dfp_shared.cli_support import settings_or_exit
from dfp_shared.hidden_states import CacheError
from dfp_shared.signals import StopSignals
from dfp_shared.specs.train import TrainSpec

from .components.data.dataset import DataError
from .components.distributed import DistInfo, init_distributed, shutdown
from .loop.prepare import Setup, TrainError
from .loop.progress import job_hooks
from .loop.train import Hooks, Training, TrainResult
from .report import finish_run
from .run_config import RunConfig
from .settings import TrainerSettings

EXIT_STOPPED = 3
EXIT_BAD_INPUT = 2


def install_stop_flag() -> threading.Event:
    return StopSignals().install().stop


def train(config: RunConfig, info: DistInfo, hooks: Hooks | None = None, source=None,
          setup: Setup | None = None) -> TrainResult:
    """Train (or resume) the drafter of ``config`` on this rank; then, when the run completed, rank 0 exports
    and evaluates it and writes the report (:func:`.report.finish_run`); last the run's final figures are
    logged and every rank waits for the others. Returns when done or asked to stop."""
    with Training.start(config, info, hooks, source=source, setup=setup) as training:
        result = training.run()
        if result.completed and info.is_main:
            result.outputs.update(finish_run(training.setup, training.drafter, result.history, result.summary))
        training.close(result)
    return result


def run_local(spec: TrainSpec, settings: TrainerSettings, *, job_id: str | None = None, stop: threading.Event | None = None,
              resume: bool = True, extra_stop=None):
    """Train in this process (one rank of a torchrun group, or alone), then export and evaluate the drafter
    (:func:`train`); returns the TrainResult.

    The run's one :class:`RunConfig` is composed here, from the spec and this trainer's settings."""
    try:  # only a source the operator configured: a spec names it, never an address
        config = RunConfig.compose(spec, settings, resume=resume)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    info = init_distributed(config.settings.device)
    hooks = job_hooks(config.settings.redis_url if job_id else None, job_id, stop, extra_stop)
    try:
        return train(config, info, hooks)
    finally:
        shutdown()


@click.command()
@click.option("--spec", "spec_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Train job spec (JSON file).")
@click.option("--job-id", default=None, help="Job whose record gets the progress (rank 0).")
@click.option("--result", "result_path", default=None, help="Where rank 0 writes the result JSON.")
@click.option("--group-run", default=None, help="Run of a trainer group: rank 0 publishes the result to the group.")
@click.option("--no-resume", is_flag=True, help="Start from scratch even if a checkpoint exists.")
def main(spec_path: str, job_id: str | None, result_path: str | None, group_run: str | None, no_resume: bool) -> None:
    settings = settings_or_exit(TrainerSettings, "trainer")
    spec = TrainSpec.model_validate(json.loads(Path(spec_path).read_text()))
    stop = install_stop_flag()
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def report(data: dict) -> None:
        if not rank0:
            return
        if result_path:
            Path(result_path).write_text(json.dumps(data))
        if group_run:
            from dfp_shared.jobs.redis_conn import connect

            from .group import GroupRuns

            GroupRuns(connect(settings.redis_url), settings.group_name).put_result(group_run, data)

    try:
        result = run_local(spec, settings, job_id=job_id, stop=stop, resume=not no_resume)
    except (TrainError, DataError, CacheError) as exc:
        report({"input_error": str(exc)})
        print(f"cannot train: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    report({"step": result.step, "total_steps": result.total_steps, "completed": result.completed,
            "outputs": result.outputs, "summary": result.summary})
    sys.exit(0 if result.completed else EXIT_STOPPED)


if __name__ == "__main__":
    main()
