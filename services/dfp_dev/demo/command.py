"""``dflash-pipeline demo``: wiring only; the run itself is in :mod:`dfp_dev.demo.run`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from .config import DemoConfig


def config_options(fn):
    """A flag for every :class:`DemoConfig` field that has a ``help``, with the field's default."""
    for f in reversed(dataclasses.fields(DemoConfig)):
        if "help" not in f.metadata:
            continue
        name = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            fn = click.option(name, is_flag=True, default=f.default, help=f.metadata["help"])(fn)
        else:
            kind = click.Choice(f.metadata["choices"]) if "choices" in f.metadata else type(f.default)
            fn = click.option(name, type=kind, default=f.default, show_default=True, help=f.metadata["help"])(fn)
    return fn


@click.command()
@click.option("--out", "out_dir", default="demo-output", show_default=True, type=click.Path(path_type=Path),
              help="Directory for the store, logs and Redis data.")
@config_options
def demo(out_dir: Path, **flags):
    """Run the whole pipeline locally on the CPU with a small Qwen3 target.

    Starts a private Redis, the API, the generation and tokenizer workers, the gRPC target
    service and the trainer as local processes, submits a pipeline job through the REST API,
    shows live progress, and ends with the completions, token shards, a trained drafter and an
    evaluation report (acceptance length of the trained vs the untrained drafter).
    """
    from .run import run_demo, tiny_target_heads

    try:
        tiny_target_heads(flags["head_dim"])
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if flags["hybrid_target"] and click.get_current_context().get_parameter_source("target").name == "DEFAULT":
        flags["target"] = "tiny"  # the hybrid target is a variant of the tiny random one
    if flags["target"] != "tiny" and flags["hybrid_target"]:
        raise click.UsageError(f"--hybrid-target builds the tiny random Qwen3.5; the {flags['target']} target is not one")
    raise SystemExit(run_demo(DemoConfig(out_dir=out_dir, **flags)))
