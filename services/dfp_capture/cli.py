"""Command-line entry point of the capture pass-through (wiring only)."""

from __future__ import annotations

import click
from dfp_shared.cli_support import with_settings

from .settings import CaptureSettings


@click.group(name="capture")
def group():
    """Capture: an OpenAI-compatible pass-through that records opted-in traffic as completion records."""


@group.command()
@with_settings(CaptureSettings, "capture", aliases={"capture_upstream": ("--upstream",)})
def serve(settings: CaptureSettings):
    """Forward /v1/chat/completions, /v1/completions, /v1/models and /health to the upstream (also
    /healthz /readyz /metrics) and write the opted-in exchanges under the capture prefix."""
    from dfp_shared.storage.uris import OutsideRoots

    from .service import serve as run_server

    try:
        run_server(settings)
    except OutsideRoots as exc:
        raise click.UsageError(f"invalid configuration: {exc}") from None
