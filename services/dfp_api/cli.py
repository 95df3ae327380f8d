"""Command-line entry points of the api service: ``serve`` and ``new-key``."""

from __future__ import annotations

import click
from dfp_shared.cli_support import common_options, settings_or_exit


@click.group(name="api")
def group():
    """REST control plane: submit, list, watch and cancel jobs."""


@group.command()
@common_options
@click.option("--host", default=None, help="Bind address [env DFLASH_HOST].")
@click.option("--port", type=int, default=None, help="HTTP port [env DFLASH_PORT].")
@click.option("--workers", type=int, default=None, help="Uvicorn worker processes [env DFLASH_WORKERS].")
@click.option("--api-keys", default=None, help="Key hashes: JSON list or file path [env DFLASH_API_KEYS].")
@click.option("--auth-disabled/--auth-enabled", default=None, help="Accept unauthenticated requests [env DFLASH_AUTH_DISABLED].")
@click.option("--rate-limit-per-s", type=float, default=None, help="Requests/s per key, 0 = off [env DFLASH_RATE_LIMIT_PER_S].")
@click.option("--rate-limit-burst", type=int, default=None, help="Burst size per key [env DFLASH_RATE_LIMIT_BURST].")
@click.option("--max-body-bytes", type=int, default=None, help="Largest request body, bytes [env DFLASH_MAX_BODY_BYTES].")
@click.option("--access-log/--no-access-log", default=None, help="Log each request [env DFLASH_ACCESS_LOG].")
def serve(**flags):
    """Serve the REST API (HTTP, /healthz /readyz /metrics, OpenAPI at /docs)."""
    from .server import serve as run_server
    from .settings import ApiSettings

    settings = settings_or_exit(ApiSettings, "api", **flags)
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
