"""Command-line entry points of the generation service (wiring only; logic lives in the modules)."""

from __future__ import annotations

import json

import click
from dfp_shared.cli_support import idle_exit_option, max_tasks_option, run_worker, with_settings

from .settings import GenerationSettings

generation_settings = with_settings(GenerationSettings, "generation",
                                    aliases={"generation_batch_size": ("--batch-size",)})


@click.group(name="generation")
def group():
    """Generation service: completions from the target model in thinking mode."""


@group.command()
@generation_settings
@max_tasks_option
@idle_exit_option
def worker(settings: GenerationSettings, max_tasks, idle_exit_s):
    """Consume generate tasks (plan, shards, finalize) from the Redis stream."""
    from dfp_shared.jobs.redis_conn import connect

    from .tasks import GenerationHandler, GenerationWorker

    worker = GenerationWorker(GenerationHandler(connect(settings.redis_url), settings))
    run_worker(worker, settings.metrics_port, max_tasks=max_tasks, idle_exit_s=idle_exit_s)


@group.command()
@generation_settings
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
        shard_size, concurrency, spec_json, settings: GenerationSettings):
    """Run a whole generate job in this process (no Redis), with a progress bar."""
    from dfp_shared.specs.generate import GenerateSpec
    from pydantic import ValidationError

    from .progress import run_with_progress

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
