"""``dflash-pipeline demo``: wiring only; the run itself is in :mod:`dfp_cli.demo_run`."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--out", "out_dir", default="demo-output", show_default=True, type=click.Path(path_type=Path),
              help="Directory for the store, logs and Redis data.")
@click.option("--prompts", type=int, default=32, show_default=True, help="Prompts from the built-in set.")
@click.option("--max-new-tokens", type=int, default=96, show_default=True, help="Tokens generated per prompt.")
@click.option("--train-steps", type=int, default=150, show_default=True, help="Drafter optimiser steps.")
@click.option("--fresh", is_flag=True, help="Delete the output directory first.")
def demo(out_dir: Path, prompts: int, max_new_tokens: int, train_steps: int, fresh: bool):
    """Run the whole pipeline locally on the CPU with a tiny Qwen3 target.

    Starts a private Redis, the API, the generation and tokenizer workers, the gRPC target
    service and the trainer as local processes, submits a pipeline job through the REST API,
    shows live progress, and ends with the completions, token shards, a trained drafter and an
    evaluation report (acceptance length of the trained vs the untrained drafter).
    """
    from .demo_run import DemoConfig, run_demo

    raise SystemExit(run_demo(DemoConfig(out_dir=out_dir, prompts=prompts, max_new_tokens=max_new_tokens,
                                         train_steps=train_steps, fresh=fresh)))
