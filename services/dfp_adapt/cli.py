"""``dflash-pipeline adapt``: from captured traffic to a served drafter (wiring only; the run is
:mod:`.adapt_run`, the served store :mod:`dfp_adapt.served_store`). Every message printed passes
:func:`~dfp_shared.printable.printable`: it may quote what the store holds."""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml
from dfp_shared.cli_support import with_settings
from dfp_shared.printable import printable
from dfp_shared.signals import StopSignals
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import NotFound, StorageError, normalize_key, visible
from dfp_shared.storage.uris import OutsideRoots

from dfp_adapt.served_store import PromotionError, ServedDrafters, check_name
from dfp_adapt.serving import V2_RUNNER, needs_v2_runner, read_drafter_config, speculative_config  # noqa: F401 (V2_RUNNER: its readers)
from dfp_adapt.settings import AdaptSettings

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


def _served(settings: AdaptSettings, name: str | None = None) -> ServedDrafters:
    try:
        served = StorageRoots.from_settings(settings).check(settings.served(), "adapt served location")
        return ServedDrafters(served, name or settings.adapt_name, settings.s3_endpoint_url)
    except (OutsideRoots, PromotionError) as exc:
        raise click.UsageError(printable(str(exc))) from None


def _failed(exc: Exception) -> click.ClickException:
    """The command's failure, its message (which may quote the store's files) without control characters."""
    return click.ClickException(printable(str(exc)))


def _print(event: dict) -> None:
    click.echo(printable(json.dumps(event, indent=1)))


@group.command()
@with_settings(AdaptSettings, "adapt")
def run(settings: AdaptSettings):
    """One run: the window's traffic, a candidate trained and evaluated, promoted or refused; prints the decision."""
    from dfp_shared.api_client import Api

    from dfp_adapt.run import AdaptError, JobsApi, adapt_once

    key = settings.api_key.get_secret_value() if settings.api_key else None
    jobs = JobsApi(Api(settings.api_url, key), settings.adapt_poll_s, settings.adapt_timeout_s)

    def stopped(count: int, signum: int) -> None:  # e.g. the CronJob's deadline: end as a failed run, the served
        raise AdaptError(f"stopped by signal {signum}")  # store's lock released on the way out

    try:
        with StopSignals(stopped):
            event = adapt_once(jobs, settings, _stages(settings.adapt_spec))
    except (AdaptError, OutsideRoots, PromotionError, StorageError, ValueError) as exc:
        raise _failed(exc) from None
    _print(event)


@group.command()
@with_settings(AdaptSettings, "adapt")
@click.option("--reason", default="", help="Why, recorded in the history (at most 512 characters).")
def rollback(settings: AdaptSettings, reason: str):
    """Serve again the drafter version that was current before the current one (the pointer moves back)."""
    if len(reason) > 512:
        raise click.UsageError("--reason: at most 512 characters")
    try:
        _print(_served(settings).rollback(reason))
    except (PromotionError, StorageError) as exc:
        raise _failed(exc) from None


@group.command()
@with_settings(AdaptSettings, "adapt")
def history(settings: AdaptSettings):
    """The served drafter's versions and decisions, as JSON."""
    try:
        _print(_served(settings).history())
    except (PromotionError, StorageError) as exc:
        raise _failed(exc) from None


def _checked_name(ctx, param, value: str | None) -> str | None:
    try:
        return value if value is None else check_name(value)
    except PromotionError as exc:
        raise click.BadParameter(str(exc)) from None


def _configuration(settings: AdaptSettings, name: str | None) -> tuple[ServedDrafters, dict]:
    served = _served(settings, name)
    config = served.configuration()
    if config is None:
        raise PromotionError(f"{served.uri}: nothing is served yet (no configuration promoted)")
    return served, config


@group.command()
@with_settings(AdaptSettings, "adapt")
@click.argument("name", required=False, callback=_checked_name)
@click.option("--speculative-config", "as_config", is_flag=True,
              help="Print the --speculative-config JSON vLLM serves the drafter with, instead of its path.")
@click.option("--attention-backend", default="", help="Attention backend to name in that JSON (e.g. FLASH_ATTN).")
@click.option("--download", type=click.Path(file_okay=False), default=None,
              help="Copy the served version into this new or empty directory first, and name the copy.")
def current(settings: AdaptSettings, name: str | None, as_config: bool, attention_backend: str, download: str | None):
    """The drafter serving loads: the served version's directory (NAME: the served drafter, default --adapt-name).

    Resolved through the served store's pointer at each call, so a serving pod that runs it as it starts loads one
    whole version, the one promoted (or rolled back to) last. With n-gram or no speculation served there is no
    drafter: it says so and fails (``adapt serving-config`` prints the serving line for any configuration)."""
    try:
        served, config = _configuration(settings, name)
        if "version" not in config:
            raise PromotionError(f"{served.uri}: serves {config['method']} speculation, no drafter: there is no "
                                 "drafter to download (dflash-pipeline adapt serving-config prints its serving line)")
        drafter = read_drafter_config(served.store, f"versions/{config['version']}/config.json")
        path = _download(served, config["version"], download) if download else \
            served.version_uri(config["version"]).removeprefix("file://").rstrip("/")
    except (PromotionError, StorageError, ValueError) as exc:
        raise _failed(exc) from None
    if not as_config:
        click.echo(printable(path, keep_newlines=False))
        return
    _echo_spec(config, path, drafter, attention_backend)


@group.command(name="serving-config")
@with_settings(AdaptSettings, "adapt")
@click.argument("name", required=False, callback=_checked_name)
@click.option("--attention-backend", default="", help="Attention backend to name for a drafter (e.g. FLASH_ATTN).")
@click.option("--download", type=click.Path(file_okay=False), default=None,
              help="For a drafter: copy the served version into this new or empty directory and name the copy.")
def serving_config(settings: AdaptSettings, name: str | None, attention_backend: str, download: str | None):
    """vLLM's --speculative-config JSON for the configuration served (a drafter, n-gram, or null: no speculation).

    Serving runs: vllm serve ... --speculative-config "$(dflash-pipeline adapt serving-config NAME)"
    """
    try:
        served, config = _configuration(settings, name)
        drafter, path = None, None
        if "version" in config:
            drafter = read_drafter_config(served.store, f"versions/{config['version']}/config.json")
            path = _download(served, config["version"], download) if download else \
                served.version_uri(config["version"]).removeprefix("file://").rstrip("/")
    except (PromotionError, StorageError, ValueError) as exc:
        raise _failed(exc) from None
    _echo_spec(config, path, drafter, attention_backend)


def _echo_spec(config: dict, path: str | None, drafter: dict | None, attention_backend: str) -> None:
    if drafter is not None and needs_v2_runner(drafter):
        click.echo("vLLM serves this drafter with VLLM_USE_V2_MODEL_RUNNER=1 set", err=True)
    spec = speculative_config(config, path, drafter, attention_backend)
    click.echo(printable(json.dumps(spec), keep_newlines=False))


def _download(served: ServedDrafters, version: int, directory: str) -> str:
    """Copy the served version's files into ``directory`` (new or empty: a copy is never a mix of two versions)."""
    target = Path(directory).resolve()
    if target.exists() and any(target.iterdir()):
        raise PromotionError(f"--download {target}: not empty; name a new or empty directory")
    prefix = f"versions/{version}/"
    target.mkdir(parents=True, exist_ok=True)
    for key in list(visible(served.store.list(prefix))):
        try:
            served.store.get_file(key, target / normalize_key(key[len(prefix):]))  # a key's '..' is refused
        except NotFound:
            raise PromotionError(f"{served.store.url(key)}: gone while it was copied") from None
    return str(target)
