"""Command-line entry points of the target service."""

import click
from dfp_shared.cli_support import with_settings

from .settings import TargetSettings


@click.group(name="target")
def group():
    """Target model server: hidden states of the frozen target's layers over gRPC, batched across callers."""


@group.command()
@with_settings(TargetSettings, "target")
def serve(settings: TargetSettings):
    """Serve the target's hidden states over gRPC (port 50051 by default)."""
    from .service import serve as run

    run(settings)
