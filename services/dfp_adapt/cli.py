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
from dfp_shared.specs.train import MAX_BLOCK_SIZE
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import NotFound, StorageError, normalize_key, visible
from dfp_shared.storage.uris import OutsideRoots

from dfp_adapt.served_store import PromotionError, ServedDrafters, check_name
from dfp_adapt.settings import AdaptSettings

MAX_SPEC_BYTES = 1 << 20
MAX_CONFIG_BYTES = 1 << 20
DSPARK = "Qwen3DSparkModel"  # the architecture vLLM serves as method dspark (the others: dflash)
V2_RUNNER = (DSPARK, "DFlash2DraftModel")  # the architectures vLLM serves on its V2 model runner only


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
    whole version, the one promoted (or rolled back to) last."""
    try:
        served = _served(settings, name)
        now = served.current()
        if now is None:
            raise PromotionError(f"{served.uri}: nothing is served yet (no version promoted)")
        config = _drafter_config(served, now.version)
        path = _download(served, now.version, download) if download else now.uri.removeprefix("file://").rstrip("/")
    except (PromotionError, StorageError) as exc:
        raise _failed(exc) from None
    if not as_config:
        click.echo(printable(path, keep_newlines=False))
        return
    spec = {"method": "dspark" if DSPARK in config["architectures"] else "dflash", "model": path,
            "num_speculative_tokens": config["block_size"] - 1,
            **({"attention_backend": attention_backend} if attention_backend else {})}
    if set(config["architectures"]) & set(V2_RUNNER) or len(set(config["layer_types"])) > 1:
        click.echo("vLLM serves this drafter with VLLM_USE_V2_MODEL_RUNNER=1 set", err=True)
    click.echo(printable(json.dumps(spec), keep_newlines=False))


def _drafter_config(served: ServedDrafters, version: int) -> dict:
    """What the serving line needs of the served version's ``config.json``: its architectures, layer types and
    block size (bounded as a train spec bounds it)."""
    where = served.store.url(f"versions/{version}/config.json")
    with served.store.open_read(f"versions/{version}/config.json") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise PromotionError(f"{where}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(data)
    except (ValueError, RecursionError):
        raise PromotionError(f"{where}: not JSON") from None
    if not isinstance(config, dict):
        raise PromotionError(f"{where}: not a drafter's config")
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    block = dflash.get("block_size", config.get("block_size", 16))  # the trainer's reading: 16 when unsaid
    if type(block) is not int or not 2 <= block <= MAX_BLOCK_SIZE:
        raise PromotionError(f"{where}: block_size {printable(repr(block))[:32]} is not 2..{MAX_BLOCK_SIZE}")
    architectures = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    layers = config.get("layer_types") if isinstance(config.get("layer_types"), list) else []
    return {"architectures": [a for a in architectures if isinstance(a, str)], "block_size": block,
            "layer_types": [str(t) for t in layers]}


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
