"""``dflash-pipeline models``: bring a target into the format every service loads."""

from __future__ import annotations

import click
from dfp_shared.cli_support import with_settings
from dfp_shared.models.gguf_import import GGUFImportSettings
from dfp_shared.printable import printable


@click.group(name="models")
def group():
    """Import targets (GGUF checkpoints) as safetensors Hugging Face directories."""


@group.command(name="import-gguf")
@with_settings(GGUFImportSettings, "models")
@click.option("--source", required=True, help="The GGUF file (file://, s3:// or a path inside the storage roots).")
@click.option("--output", required=True, help="The model directory to write (a new prefix inside the storage roots).")
@click.option("--owner", default=None, help="Principal that owns OUTPUT (as a job's owner); default: anonymous.")
def import_gguf_command(source: str, output: str, owner: str | None, settings: GGUFImportSettings):
    """Import a GGUF file into a model directory (both inside the storage roots).

    The output gets safetensors weights (float32), config, tokenizer and chat template; the trainer, the target
    service and the generation engine then load it like any Hugging Face checkpoint. Through the API the same
    import is an `import_gguf` job (`dflash-pipeline submit import_gguf --source ... --output ...`).
    """
    from dfp_shared.models.gguf_import import GGUFError, import_gguf
    from dfp_shared.storage.roots import StorageRoots
    from dfp_shared.storage.store import StorageError

    try:
        keys = import_gguf(source, output, StorageRoots.from_settings(settings), owner,
                           endpoint_url=settings.s3_endpoint_url, max_bytes=settings.gguf_max_bytes,
                           limits=settings.gguf_limits())
    except (GGUFError, StorageError) as exc:
        raise click.ClickException(printable(str(exc))) from None
    click.echo(f"imported {source} -> {output} ({len(keys)} files)")
