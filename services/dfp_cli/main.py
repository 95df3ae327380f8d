"""The ``dflash-pipeline`` command: one subcommand group per service, plus the job client and the demo.

Groups are imported lazily so ``--help`` is fast and a service's heavy imports (torch, grpc)
load only when that service runs.
"""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click command or group
COMMANDS = {
    "api": "dfp_api.cli:group",
    "generation": "dfp_generation.cli:group",
    "tokenizer": "dfp_tokenizer.cli:group",
    "target": "dfp_target.cli:group",
    "trainer": "dfp_trainer.cli:group",
    "submit": "dfp_cli.client:submit",
    "jobs": "dfp_cli.client:jobs",
    "status": "dfp_cli.client:status",
    "cancel": "dfp_cli.client:cancel",
    "models": "dfp_cli.models:group",
    "demo": "dfp_cli.demo:demo",
    "serve-check": "dfp_cli.serve_check:serve_check",
    "build-target": "dfp_cli.demo_support.learnable_target:build_target",
}

HELP = {
    "api": "REST control plane: submit, list, watch and cancel jobs.",
    "generation": "Generation workers: completions from the target model.",
    "tokenizer": "Tokenization worker pool: completions to loss-masked token shards.",
    "target": "Hidden-state target service (gRPC).",
    "trainer": "DFlash drafter trainer.",
    "submit": "Submit a job to the API.",
    "jobs": "List jobs.",
    "status": "Show (or watch) a job's progress.",
    "cancel": "Cancel a job.",
    "models": "Import targets (GGUF checkpoints) as safetensors Hugging Face directories.",
    "demo": "Run the whole pipeline locally on the CPU with a tiny model.",
    "serve-check": "Serve an exported drafter with a real vLLM and check it against the project.",
    "build-target": "Build (once, then cached) a small Qwen3 target trained on the standard library.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"

            @click.command(name=name, help=f"(unavailable: {reason})")
            def unavailable():
                raise click.ClickException(f"{name} is not available: {reason}")

            return unavailable

    def format_commands(self, ctx, formatter):
        rows = [(name, HELP.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="dflash-pipeline")
def cli():
    """dflash-pipeline: prompts in, a trained DFlash speculative-decoding drafter out.

    Every setting comes from a flag or an environment variable with the DFLASH_ prefix
    (flag --redis-url = DFLASH_REDIS_URL); flags win. Secrets come from the environment only.
    """


if __name__ == "__main__":
    cli()
