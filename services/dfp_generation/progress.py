"""A terminal progress bar for local generation runs: prompts, output tokens, tokens/s, ETA."""

from __future__ import annotations

import time

from dfp_shared.specs.generate import GenerateSpec
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .local import run_local
from .settings import GenerationSettings


def run_with_progress(spec: GenerateSpec, settings: GenerationSettings) -> dict:
    """Run ``spec`` locally with a live bar; returns the run's totals and outputs."""
    start = time.monotonic()
    tokens = 0
    with Progress(TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), transient=False) as bar:
        task = bar.add_task("generate", total=None, rate="")

        def on_plan(plan):
            bar.update(task, total=plan.prompts * spec.samples_per_prompt)

        def on_result(res):
            nonlocal tokens
            tokens += res.completion_tokens
            rate = tokens / max(1e-9, time.monotonic() - start)
            bar.update(task, advance=1, rate=f"{tokens} tok, {rate:.1f} tok/s")

        def on_shard(outcome):
            if outcome.skipped:  # done by an earlier run
                bar.update(task, advance=outcome.completions + outcome.errors)

        result = run_local(spec, settings, on_plan=on_plan, on_result=on_result, on_shard=on_shard)
    return {**result.totals(), "outputs": result.outputs, "shards": len(result.outcomes),
            "seconds": round(time.monotonic() - start, 3)}
