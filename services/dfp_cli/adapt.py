"""``dflash-pipeline adapt``: from captured traffic to a served drafter (wiring only; the run is
:mod:`.adapt_run`, the served store :mod:`dfp_shared.promotion`)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml
from dfp_shared.cli_support import with_settings
from dfp_shared.printable import printable
from dfp_shared.promotion import PromotionError, ServedDrafters
from dfp_shared.signals import StopSignals
from dfp_shared.storage import StorageError
from dfp_shared.storage_roots import StorageRoots
from dfp_shared.storage_uris import OutsideRoots

from .adapt_settings import AdaptSettings

MAX_SPEC_BYTES = 1 << 20


@click.group(name="adapt")
def group():
    """Train a drafter on captured traffic, promote it when it beats the served one, roll back."""


def _stages(path: str) -> dict:
    if not path:
        return {}
    text = Path(path).read_bytes()
    if len(text) > MAX_SPEC_BYTES:
        raise click.UsageError(f"{path}: larger than {MAX_SPEC_BYTES} bytes")
    try:
        stages = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise click.UsageError(f"{path}: not valid YAML/JSON: {exc}") from None
    if not isinstance(stages, dict) or not all(isinstance(v, dict) for v in stages.values()):
        raise click.UsageError(f"{path}: expected a mapping of stage -> spec fields")
    return stages


def _served(settings: AdaptSettings) -> ServedDrafters:
    try:
        served = StorageRoots.from_settings(settings).check(settings.served(), "adapt served location")
        return ServedDrafters(served, settings.adapt_name, settings.s3_endpoint_url)
    except (OutsideRoots, PromotionError) as exc:
        raise click.UsageError(str(exc)) from None


def _print(event: dict) -> None:
    click.echo(printable(json.dumps(event, indent=1)))


@group.command()
@with_settings(AdaptSettings, "adapt")
def run(settings: AdaptSettings):
    """One run: the window's traffic, a candidate trained and evaluated, promoted or refused; prints the decision."""
    from .adapt_run import AdaptError, JobsApi, adapt_once
    from .api_client import Api

    key = settings.api_key.get_secret_value() if settings.api_key else None
    jobs = JobsApi(Api(settings.api_url, key), settings.adapt_poll_s, settings.adapt_timeout_s)

    def stopped(count: int, signum: int) -> None:  # e.g. the CronJob's deadline: end as a failed run, the served
        raise AdaptError(f"stopped by signal {signum}")  # store's lock released on the way out

    try:
        with StopSignals(stopped):
            event = adapt_once(jobs, settings, _stages(settings.adapt_spec))
    except (AdaptError, OutsideRoots, PromotionError, StorageError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    _print(event)


@group.command()
@with_settings(AdaptSettings, "adapt")
@click.option("--reason", default="", help="Why, recorded in the history (at most 512 characters).")
def rollback(settings: AdaptSettings, reason: str):
    """Restore the served drafter that was current before the current one, byte for byte."""
    if len(reason) > 512:
        raise click.UsageError("--reason: at most 512 characters")
    try:
        _print(_served(settings).rollback(reason))
    except PromotionError as exc:
        raise click.ClickException(str(exc)) from None


@group.command()
@with_settings(AdaptSettings, "adapt")
def history(settings: AdaptSettings):
    """The served drafter's versions and decisions, as JSON."""
    try:
        _print(_served(settings).history())
    except PromotionError as exc:
        raise click.ClickException(str(exc)) from None
