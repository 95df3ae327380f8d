"""Command-line entry points of the trainer service (wiring only)."""

from __future__ import annotations

import json

import click
from dfp_shared.cli_support import common_options, settings_or_exit

from .settings import TrainerSettings


def _trainer_options(fn):
    fn = click.option("--target-url", default=None, help="The target named `default`: inprocess or gRPC "
                                                           "address(es) [env DFLASH_TARGET_URL].")(fn)
    fn = click.option("--device", default=None, help="auto, cpu, cuda [env DFLASH_DEVICE].")(fn)
    fn = click.option("--nproc-per-node", type=int, default=None,
                      help="Training processes; >1 runs torchrun [env DFLASH_NPROC_PER_NODE].")(fn)
    return common_options(fn)


@click.group(name="trainer")
def group():
    """DFlash drafter trainer."""


@group.command()
@_trainer_options
@click.option("--max-tasks", type=int, default=None, help="Exit after this many train tasks.")
@click.option("--idle-exit", type=float, default=None, help="Exit after this many idle seconds.")
def worker(max_tasks, idle_exit, **flags):
    """Claim train jobs from the Redis stream and run them (resuming from checkpoints)."""
    from dfp_shared.jobs import JobStore
    from dfp_shared.metrics import start_metrics_server
    from dfp_shared.queue import TaskQueue
    from dfp_shared.redis_conn import connect
    from dfp_shared.worker import Worker

    from .worker import TrainHandler

    settings = settings_or_exit(TrainerSettings, "trainer", **flags)
    start_metrics_server(settings.metrics_port)
    r = connect(settings.redis_url)
    queue = TaskQueue(r, "train", lease_ms=settings.lease_ms, max_deliveries=settings.max_deliveries)
    w = Worker(queue, JobStore(r), TrainHandler(settings, r))
    w.install_signal_handlers()
    w.run(max_tasks=max_tasks, idle_exit_s=idle_exit)


@group.command()
@_trainer_options
@click.option("--dataset", required=True, help="Token dataset prefix.")
@click.option("--target", required=True, help="Target model directory.")
@click.option("--output", required=True, help="Output prefix (checkpoints, drafter, report).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help="Any train spec field, e.g. steps=200.")
@click.option("--no-resume", is_flag=True, help="Ignore existing checkpoints.")
def train(dataset, target, output, overrides, no_resume, **flags):
    """Run one training directly (no Redis): resumes from the output's latest checkpoint."""
    from dfp_shared.specs.train import TrainSpec

    from .run import EXIT_STOPPED, install_stop_flag, run_local

    settings = settings_or_exit(TrainerSettings, "trainer", **flags)
    fields = {"dataset": dataset, "target": target, "output": output}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.UsageError(f"--set {item!r}: expected FIELD=VALUE")
        try:
            fields[key] = json.loads(value)
        except json.JSONDecodeError:
            fields[key] = value
    try:
        spec = TrainSpec.model_validate(fields)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if settings.nproc_per_node > 1:
        raise click.UsageError("trainer train runs one process; use torchrun -m dfp_trainer.run for several")
    from .data import DataError
    from .train import TrainError

    try:
        result = run_local(spec, settings, stop=install_stop_flag(), resume=not no_resume)
    except (TrainError, DataError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps({"step": result.step, "completed": result.completed, "outputs": result.outputs,
                           "summary": result.summary}))
    raise SystemExit(0 if result.completed else EXIT_STOPPED)
