"""Command-line entry points of the generation service (wiring only; logic lives in the modules)."""

from __future__ import annotations

import json

import click
from dfp_shared.cli_support import common_options, settings_or_exit


def engine_options(fn):
    opts = [
        click.option("--device", default=None, help="auto, cpu or cuda:N [env DFLASH_DEVICE]."),
        click.option("--dtype", default=None, help="auto, float32, bfloat16 or float16 [env DFLASH_DTYPE]."),
        click.option("--batch-size", "generation_batch_size", type=int, default=None,
                     help="Prompts per batch, transformers engine [env DFLASH_GENERATION_BATCH_SIZE]."),
        click.option("--openai-base-url", default=None, help="Base URL of the OpenAI-compatible endpoint named 'default' "
                                                                   "[env DFLASH_OPENAI_BASE_URL]."),
        click.option("--openai-model", default=None, help="Default served model name [env DFLASH_OPENAI_MODEL]."),
        click.option("--checkpoint-interval-s", type=float, default=None,
                     help="Seconds between partial-shard checkpoints [env DFLASH_CHECKPOINT_INTERVAL_S]."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@click.group(name="generation")
def group():
    """Generation service: completions from the target model in thinking mode."""


@group.command()
@common_options
@engine_options
@click.option("--lease-ms", type=int, default=None, help="Task lease in ms [env DFLASH_LEASE_MS].")
@click.option("--max-tasks", type=int, default=None, help="Exit after this many tasks (default: run until stopped).")
@click.option("--idle-exit-s", type=float, default=None, help="Exit after this many idle seconds (default: never).")
def worker(max_tasks, idle_exit_s, **flags):
    """Consume generate tasks (plan, shards, finalize) from the Redis stream."""
    from dfp_shared.metrics import start_metrics_server
    from dfp_shared.redis_conn import connect

    from .settings import GenerationSettings
    from .tasks import GenerationHandler, GenerationWorker

    settings = settings_or_exit(GenerationSettings, "generation", **flags)
    start_metrics_server(settings.metrics_port)
    worker = GenerationWorker(GenerationHandler(connect(settings.redis_url), settings))
    worker.install_signal_handlers()
    worker.run(max_tasks=max_tasks, idle_exit_s=idle_exit_s)


@group.command()
@common_options
@engine_options
@click.option("--prompts", required=True, help="Prompt JSONL file or prefix (file://, s3:// or a path).")
@click.option("--output", required=True, help="Output prefix for completion shards.")
@click.option("--model", default=None, help="Target model directory (transformers engine).")
@click.option("--engine", type=click.Choice(["transformers", "openai"]), default=None, help="Generation engine.")
@click.option("--temperature", type=float, default=None, help="Sampling temperature (0 = greedy).")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling mass.")
@click.option("--max-new-tokens", type=int, default=None, help="Most generated tokens per completion.")
@click.option("--seed", type=int, default=None, help="Base seed.")
@click.option("--thinking/--no-thinking", default=None, help="Thinking mode of the chat template.")
@click.option("--samples-per-prompt", type=int, default=None, help="Completions per prompt.")
@click.option("--shard-size", type=int, default=None, help="Prompts per output shard.")
@click.option("--concurrency", type=int, default=None, help="Requests in flight (openai engine).")
@click.option("--spec-json", default=None, help="Further GenerateSpec fields as a JSON object.")
def run(prompts, output, model, engine, temperature, top_p, max_new_tokens, seed, thinking, samples_per_prompt,
        shard_size, concurrency, spec_json, **flags):
    """Run a whole generate job in this process (no Redis), with a progress bar."""
    from dfp_shared.specs.generate import GenerateSpec
    from pydantic import ValidationError

    from .progress import run_with_progress
    from .settings import GenerationSettings

    settings = settings_or_exit(GenerationSettings, "generation", **flags)
    fields = dict(prompts=prompts, output=output, model=model, engine=engine, temperature=temperature, top_p=top_p,
                  max_new_tokens=max_new_tokens, seed=seed, thinking=thinking, samples_per_prompt=samples_per_prompt,
                  shard_size=shard_size, concurrency=concurrency)
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        fields.update(json.loads(spec_json) if spec_json else {})
        spec = GenerateSpec.model_validate(fields)
    except (ValueError, ValidationError) as exc:
        raise click.UsageError(f"invalid generate spec: {exc}") from None
    totals = run_with_progress(spec, settings)
    click.echo(json.dumps(totals))
