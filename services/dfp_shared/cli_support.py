"""Service entry points: one click flag per settings field, settings from flags over env, FIELD=VALUE pairs."""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import click
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode

from dfp_shared.config import ConfigError, env_name, is_secret, load_settings
from dfp_shared.logs import setup_logging


class _Unconverted(click.ParamType):
    """A flag's text handed to the settings class as is: a flag and its variable share one validation and message."""

    def __init__(self, name: str):
        self.name = name

    def convert(self, value, param, ctx):
        return value


class _UnconvertedChoice(click.Choice):
    def convert(self, value, param, ctx):
        return value


def _value_type(annotation: Any) -> Any:
    """The annotation without ``None`` (``str | None`` -> ``str``)."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _is_structured(kind: Any) -> bool:
    origin = get_origin(kind) or kind
    return origin in (list, tuple, set, dict) or (isinstance(origin, type) and issubclass(origin, BaseModel))


def setting_option(settings_cls: type[BaseSettings], name: str, info: FieldInfo,
                   aliases: tuple[str, ...] = ()) -> click.Option:
    """The flag of one settings field: ``--field-name`` (booleans ``--x/--no-x``), help from its description."""
    flag = "--" + name.replace("_", "-")
    kind = _value_type(info.annotation)
    help_text = f"{info.description} [env {env_name(settings_cls, name)}]"
    if kind is bool:
        return click.Option([f"{flag}/--no-{flag[2:]}", *aliases, name], default=None, help=help_text)
    if get_origin(kind) is Literal:
        param_type = _UnconvertedChoice([str(c) for c in get_args(kind)])
    elif _is_structured(kind):
        param_type = _Unconverted("text" if NoDecode in info.metadata else "json")
    else:
        param_type = _Unconverted({int: "integer", float: "float", Path: "path"}.get(kind, "text"))
    return click.Option([flag, *aliases, name], type=param_type, default=None, help=help_text)


def _flag_value(info: FieldInfo, text: Any) -> Any:
    """A structured field's flag as its variable reads: JSON, unless the field parses its own text form."""
    if text is None or NoDecode in info.metadata or not _is_structured(_value_type(info.annotation)):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text  # the settings class says what is wrong with it


def flag_fields(settings_cls: type[BaseSettings]) -> dict[str, FieldInfo]:
    """The fields of ``settings_cls`` that have a flag: all but the secrets (environment only)."""
    return {name: info for name, info in settings_cls.model_fields.items() if not is_secret(info)}


def settings_or_exit(settings_cls: type[BaseSettings], service: str, **flags):
    """Load settings (flags over env), then logging; a bad value is a usage error naming it and the reason."""
    try:
        settings = load_settings(settings_cls, **flags)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    setup_logging(settings.log_level, settings.log_json, service=service)
    return settings


def with_settings(settings_cls: type[BaseSettings], service: str, aliases: dict[str, tuple[str, ...]] | None = None):
    """Decorate a click command: a flag per settings field, and the command gets ``settings=`` built from them.

    ``aliases`` gives a field further flag names (``{"field": ("--old-name",)}``; a boolean's off name
    as ``" /--old-off"``). Flags win over the environment; secrets have no flag.
    """
    fields = flag_fields(settings_cls)
    aliases = aliases or {}
    unknown = set(aliases) - set(fields)
    if unknown:
        raise ValueError(f"aliases name fields without a flag in {settings_cls.__name__}: {sorted(unknown)}")

    def decorate(fn):
        taken = {p.name for p in getattr(fn, "__click_params__", [])} & set(fields)
        if taken:
            raise ValueError(f"{fn.__name__}: options {sorted(taken)} are {settings_cls.__name__} fields")

        @functools.wraps(fn)
        def command(**kwargs):
            flags = {name: _flag_value(info, kwargs.pop(name)) for name, info in fields.items()}
            return fn(settings=settings_or_exit(settings_cls, service, **flags), **kwargs)

        command.settings_class = settings_cls
        params = command.__dict__.setdefault("__click_params__", [])
        params.extend(setting_option(settings_cls, name, info, aliases.get(name, ()))
                      for name, info in reversed(fields.items()))
        return command

    return decorate


max_tasks_option = click.option("--max-tasks", type=int, default=None,
                                help="Exit after this many tasks (default: run until stopped).")
idle_exit_option = click.option("--idle-exit-s", type=float, default=None,
                                help="Exit after this many idle seconds (default: never).")


def run_worker(worker, metrics_port: int, *, max_tasks: int | None = None, idle_exit_s: float | None = None) -> None:
    """Serve /metrics (0: not), stop cleanly on SIGTERM, and run a :class:`~dfp_shared.jobs.worker.Worker` loop."""
    from dfp_shared.metrics import start_metrics_server

    start_metrics_server(metrics_port)
    worker.install_signal_handlers()
    worker.run(max_tasks=max_tasks, idle_exit_s=idle_exit_s)


def parse_value(text: str) -> Any:
    """The value of a FIELD=VALUE pair: JSON (numbers, true/false/null, "quoted", objects, arrays), else a YAML
    flow list or mapping (``[a, b]``), boolean (``yes``, ``True``) or null (``~``); any other text is itself."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, (list, dict)) and text.lstrip()[:1] in ("[", "{"):
        return value
    if isinstance(value, bool) or (value is None and text.strip()):
        return value
    return text


def put_field(spec: dict, dotted: str, value: Any) -> None:
    """Set ``spec[a][b] = value`` for ``a.b``, making the mappings on the way."""
    parts = dotted.split(".")
    node = spec
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise click.BadParameter(f"{dotted}: {part} is not a mapping")
    node[parts[-1]] = value


def apply_assignments(spec: dict, items: tuple[str, ...] | list[str], param_hint: str = "--set",
                      prefix: str = "") -> dict:
    """Apply FIELD=VALUE pairs (dotted fields nest) to ``spec``, under ``prefix.`` if given; returns ``spec``."""
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r}: expected FIELD=VALUE", param_hint=param_hint)
        put_field(spec, f"{prefix}.{key.strip()}" if prefix else key.strip(), parse_value(text))
    return spec
