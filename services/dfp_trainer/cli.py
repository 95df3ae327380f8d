"""Command-line entry points of the trainer service (wiring only)."""

from __future__ import annotations

import json

import click
from dfp_shared.cli_support import apply_assignments, max_tasks_option, run_worker, with_settings

from .settings import TrainerSettings

trainer_settings = with_settings(TrainerSettings, "trainer")


@click.group(name="trainer")
def group():
    """DFlash drafter trainer."""


@group.command()
@trainer_settings
@max_tasks_option
@click.option("--idle-exit", type=float, default=None, help="Exit after this many idle seconds.")
def worker(settings: TrainerSettings, max_tasks, idle_exit):
    """Claim train jobs from the Redis stream and run them (resuming from checkpoints)."""
    from dfp_shared.jobs.queue import TaskQueue
    from dfp_shared.jobs.redis_conn import connect
    from dfp_shared.jobs.store import JobStore
    from dfp_shared.jobs.types import TRAIN
    from dfp_shared.jobs.worker import Worker

    from .worker import TrainHandler

    r = connect(settings.redis_url)
    if settings.nproc_per_node > 1 or settings.nodes > 1:  # torchrun children set the gauges
        children_gauges(settings)
    if settings.node_rank > 0:  # a member of a trainer group: member 0 claims, this one follows
        from dfp_shared.metrics import start_metrics_server
        from dfp_shared.signals import StopSignals

        from .jobs.launch import follow

        start_metrics_server(settings.metrics_port)  # what the pod's probes check
        follow(settings, r, StopSignals().install().stop)
        return
    queue = TaskQueue(r, TRAIN.stream, lease_ms=settings.lease_ms, max_deliveries=settings.max_deliveries)
    worker = Worker(queue, JobStore(r), TrainHandler(settings, r))
    run_worker(worker, settings.metrics_port, max_tasks=max_tasks, idle_exit_s=idle_exit)


def children_gauges(settings: TrainerSettings) -> None:
    """The torchrun children's gauges, served by this worker: a directory of their own for its lifetime."""
    import atexit
    import os

    from .components.metrics.gauges import MULTIPROC_ENV, serve_children_gauges
    from .settings import scratch_dir

    tmp = scratch_dir(settings.work_dir, "dflash-gauges-")
    atexit.register(tmp.cleanup)
    os.environ[MULTIPROC_ENV] = str(serve_children_gauges(tmp.name))  # what child_env passes on


@group.command()
@trainer_settings
@click.option("--dataset", required=True, help="Token dataset prefix.")
@click.option("--target", required=True, help="Target model directory.")
@click.option("--output", required=True, help="Output prefix (checkpoints, drafter, report).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help="Any train spec field, e.g. steps=200.")
@click.option("--no-resume", is_flag=True, help="Ignore existing checkpoints.")
def train(dataset, target, output, overrides, no_resume, settings: TrainerSettings):
    """Run one training directly (no Redis): resumes from the output's latest checkpoint."""
    from dfp_shared.specs.train import TrainSpec

    from .run import EXIT_STOPPED, install_stop_flag, run_local

    fields = apply_assignments({"dataset": dataset, "target": target, "output": output}, overrides)
    try:
        spec = TrainSpec.model_validate(fields)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if settings.nproc_per_node > 1:
        raise click.UsageError("trainer train runs one process; use torchrun -m dfp_trainer.run for several")
    from .components.data.dataset import DataError
    from .loop.prepare import TrainError

    try:
        result = run_local(spec, settings, stop=install_stop_flag(), resume=not no_resume)
    except (TrainError, DataError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps({"step": result.step, "completed": result.completed, "outputs": result.outputs,
                           "summary": result.summary}))
    raise SystemExit(0 if result.completed else EXIT_STOPPED)


@group.command(name="reference-decode")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Target model directory.")
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False),
              help="Exported drafter directory (config.json, model.safetensors).")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSON file: a list of chat prompts, each a list of {role, content} messages.")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="Tokens generated per prompt.")
@click.option("--thinking/--no-thinking", default=True, show_default=True,
              help="Thinking mode of the chat template (the one the drafter was trained in).")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Where the JSON result goes.")
def reference_decode(target, drafter, prompts_path, max_new_tokens, thinking, out_path):
    """Plain greedy outputs and the drafter's acceptance counts by the project's speculative decoding
    (what a serving engine must reproduce)."""
    from pathlib import Path

    import torch

    from .evaluate.serve_reference import reference_decode as decode

    prompts = json.loads(Path(prompts_path).read_text())
    if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
        raise click.UsageError(f"{prompts_path}: expected a JSON list of message lists")
    torch.set_num_threads(1)  # tiny models gain nothing from more; a serving engine shares the machine
    result = decode(target, drafter, prompts, max_new_tokens=max_new_tokens, enable_thinking=thinking)
    Path(out_path).write_text(json.dumps(result))
