"""Helpers for service entry points: settings from flags + env, clear config errors, logging."""

from __future__ import annotations

import click

from .config import CommonSettings, ConfigError, load_settings
from .logs import setup_logging


def common_options(fn):
    """The flags every service shares (each also readable from its DFLASH_ variable)."""
    opts = [
        click.option("--redis-url", default=None, help="Redis URL [env DFLASH_REDIS_URL]."),
        click.option("--storage-url", default=None, help="Object storage root, file:// or s3:// [env DFLASH_STORAGE_URL]."),
        click.option("--s3-endpoint-url", default=None, help="S3-compatible endpoint [env DFLASH_S3_ENDPOINT_URL]."),
        click.option("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR [env DFLASH_LOG_LEVEL]."),
        click.option("--metrics-port", type=int, default=None, help="Prometheus /metrics port, 0 = off [env DFLASH_METRICS_PORT]."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def settings_or_exit(settings_cls: type[CommonSettings], service: str, **flags):
    """Load settings (flags over env); on a bad value print the variable and reason and exit 2."""
    try:
        settings = load_settings(settings_cls, **flags)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    setup_logging(settings.log_level, settings.log_json, service=service)
    return settings
