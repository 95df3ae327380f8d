"""Command-line entry points of the tokenizer service (wiring only; logic lives in the modules)."""

from __future__ import annotations

import json
import time

import click
from dfp_shared.cli_support import idle_exit_option, with_settings

from .settings import TokenizerSettings

tokenizer_settings = with_settings(TokenizerSettings, "tokenizer")
STARTED = time.time()  # the command's start: its start-up is reported apart from the tokenization


@click.group(name="tokenizer")
def group():
    """Tokenization worker pool: completions to loss-masked token shards."""


@group.command()
@tokenizer_settings
@idle_exit_option
def worker(settings: TokenizerSettings, idle_exit_s):
    """Consume tokenize tasks (plan, files, finalize) with one process per core."""
    import os
    import tempfile

    n = settings.process_count()
    if n > 1 and settings.metrics_port:  # before prometheus_client loads: one /metrics for all processes
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="dfp-tokenizer-metrics-"))
    from .pool import Pool, run_process, start_pool_metrics

    start_pool_metrics(settings.metrics_port)
    if n == 1:
        run_process(settings, idle_exit_s=idle_exit_s)
    else:
        Pool(settings, n, idle_exit_s=idle_exit_s).run()


@group.command()
@tokenizer_settings
@click.option("--input", "input_", required=True, help="Completion JSONL file or prefix (file://, s3:// or a path).")
@click.option("--output", required=True, help="Dataset prefix for shards, manifest, stats and errors.")
@click.option("--tokenizer", "tokenizer", required=True, help="Hugging Face tokenizer directory (local or s3://).")
@click.option("--thinking/--no-thinking", default=None, help="Thinking mode of the chat template.")
@click.option("--train-reasoning/--no-train-reasoning", default=None, help="Train the reasoning tokens.")
@click.option("--train-turns", type=click.Choice(["all", "last"]), default=None, help="Assistant turns to train.")
@click.option("--max-length", type=int, default=None, help="Longest sample in tokens.")
@click.option("--truncation", type=click.Choice(["drop", "truncate"]), default=None, help="Policy over max-length.")
@click.option("--spec-json", default=None, help="Further TokenizeSpec fields as a JSON object.")
def run(input_, output, tokenizer, thinking, train_reasoning, train_turns, max_length, truncation, spec_json,
        settings: TokenizerSettings):
    """Submit a tokenize job to Redis and run the worker pool here until it ends, with a progress bar."""
    from pydantic import ValidationError

    from .local import run_job

    spec = {k: v for k, v in dict(input=input_, output=output, tokenizer=tokenizer, thinking=thinking,
                                 train_reasoning=train_reasoning, train_turns=train_turns, max_length=max_length,
                                 truncation=truncation).items() if v is not None}
    try:
        spec.update(json.loads(spec_json) if spec_json else {})
        rec, timing = run_job(settings, spec, started=STARTED)
    except (ValueError, ValidationError) as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(json.dumps({"job_id": rec.id, "state": rec.state.value, "error": rec.error, "outputs": rec.outputs,
                           "counters": rec.counters, "timing": timing}, indent=1))
    if rec.state.value != "succeeded":
        raise SystemExit(1)
