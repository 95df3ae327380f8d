"""Command-line entry points of the api service: ``serve`` and ``new-key``."""

from __future__ import annotations

import click
from dfp_shared.cli_support import with_settings

from .settings import ApiSettings


@click.group(name="api")
def group():
    """REST control plane: submit, list, watch and cancel jobs."""


@group.command()
@with_settings(ApiSettings, "api", aliases={"auth_disabled": (" /--auth-enabled",)})
def serve(settings: ApiSettings):
    """Serve the REST API (HTTP, /healthz /readyz /metrics, OpenAPI at /docs); keys come from DFLASH_API_KEYS."""
    from .server import serve as run_server

    run_server(settings)


@group.command("new-key")
@click.option("--name", required=True, help="Name of the key holder (shown in logs and rate limits).")
@click.option("--scope", "scopes", multiple=True, type=click.Choice(["read", "write", "admin"]),
              default=("read", "write"), show_default=True,
              help="Scopes to grant (repeatable); admin sees and cancels every key's jobs.")
@click.option("--expires-at", default=None,
              help="When the key stops working: ISO 8601 (UTC unless an offset is given) or Unix seconds.")
def new_key(name: str, scopes: tuple[str, ...], expires_at: str | None):
    """Make a random API key; prints the key (give it to the client) and its DFLASH_API_KEYS entry."""
    from .auth import check_name, key_entry_json, parse_expiry
    from .auth import new_key as make

    try:
        check_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--name") from None
    try:
        expiry = parse_expiry(expires_at) if expires_at is not None else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--expires-at") from None
    key = make()
    click.echo(f"key:   {key}")
    click.echo(f"entry: {key_entry_json(name, key, list(scopes), expiry)}")
