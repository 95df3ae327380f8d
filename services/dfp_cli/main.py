"""The ``dflash-pipeline`` command: one subcommand group per service, plus the job client, and the commands
other installed packages register under the ``dflash_pipeline.commands`` entry point group (the development
commands demo, serve-check and build-target come that way where the development package is installed; the
images leave it out).

Groups are imported lazily so ``--help`` is fast and a service's heavy imports (torch, grpc)
load only when that service runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import click

# name -> "module:attribute" of a click command or group
COMMANDS = {
    "api": "dfp_api.cli:group",
    "generation": "dfp_generation.cli:group",
    "tokenizer": "dfp_tokenizer.cli:group",
    "target": "dfp_target.cli:group",
    "trainer": "dfp_trainer.cli:group",
    "capture": "dfp_capture.cli:group",
    "submit": "dfp_cli.client:submit",
    "jobs": "dfp_cli.client:jobs",
    "status": "dfp_cli.client:status",
    "cancel": "dfp_cli.client:cancel",
    "models": "dfp_cli.models:group",
    "adapt": "dfp_adapt.cli:group",
}

HELP = {
    "api": "REST control plane: submit, list, watch and cancel jobs.",
    "generation": "Generation workers: completions from the target model.",
    "tokenizer": "Tokenization worker pool: completions to loss-masked token shards.",
    "target": "Hidden-state target service (gRPC).",
    "trainer": "DFlash drafter trainer.",
    "capture": "OpenAI-compatible pass-through that records opted-in traffic.",
    "submit": "Submit a job to the API.",
    "jobs": "List jobs.",
    "status": "Show (or watch) a job's progress.",
    "cancel": "Cancel a job.",
    "models": "Import targets (GGUF checkpoints) as safetensors Hugging Face directories.",
    "adapt": "Train a drafter on captured traffic; promote it when it beats the served one; roll back.",
}


ENTRY_POINTS = "dflash_pipeline.commands"  # each entry: a module with COMMANDS and HELP tables of this shape


def registered() -> list:
    """The command tables of the installed packages that register some; an entry whose package is not
    installed (its name in the metadata, its module gone, as in the images) is left out."""
    tables = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        try:
            tables.append(entry.load())
        except ModuleNotFoundError as exc:
            if exc.name is None or not entry.value.startswith(exc.name.split(".")[0]):
                raise
    return tables


def commands() -> tuple[dict[str, str], dict[str, str]]:
    """The command table and its help: the services' and the client's, plus those registered by entry points."""
    found, helps = dict(COMMANDS), dict(HELP)
    for table in registered():
        found.update(table.COMMANDS)
        helps.update(table.HELP)
    return found, helps


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(commands()[0])

    def get_command(self, ctx, name):
        target = commands()[0].get(name)
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
        helps = commands()[1]
        rows = [(name, helps.get(name, "")) for name in self.list_commands(ctx)]
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
