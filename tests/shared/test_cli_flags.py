"""Every settings field of every service is a flag of its commands (secrets excepted); flags win over env."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Literal

import click
import pytest
from click.testing import CliRunner
from dfp_cli.main import cli
from dfp_shared.cli_support import apply_assignments, parse_value, with_settings
from dfp_shared.config import CommonSettings, env_name, is_secret
from dfp_target.settings import TargetSettings
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings

SERVICES = Path(__file__).resolve().parents[2] / "services"
_CLASS = re.compile(r"^class (\w+)\([\w.]*Settings\):", re.M)


def _settings_classes() -> list[type[BaseSettings]]:
    """Every settings class defined under services/, found by reading the sources."""
    found = []
    for path in sorted(SERVICES.rglob("*.py")):
        names = _CLASS.findall(path.read_text())
        if names:
            module = importlib.import_module(".".join(path.relative_to(SERVICES).with_suffix("").parts))
            found += [getattr(module, n) for n in names if issubclass(getattr(module, n), BaseSettings)]
    return found


def _commands(group: click.Group = cli, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], click.Command]:
    """Every command of the CLI that builds a settings object, by its path."""
    ctx = click.Context(group)
    found = {}
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            found.update(_commands(cmd, (*path, name)))
        elif getattr(cmd.callback, "settings_class", None) is not None:
            found[(*path, name)] = cmd
    return found


CLASSES = _settings_classes()
COMMANDS = _commands()


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _required(cmd: click.Command) -> list[str]:
    """Placeholder values for the command's required hand-written options."""
    return [arg for p in cmd.params if p.required for arg in (p.opts[0], "x")]


def _invoke(path: tuple[str, ...], *args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, [*path, *args, *_required(COMMANDS[path])])


def test_discovery_finds_the_services_settings():
    names = {c.__name__ for c in CLASSES}
    assert {"CommonSettings", "ApiSettings", "GenerationSettings", "TokenizerSettings", "TargetSettings",
            "TrainerSettings"} <= names
    assert len(COMMANDS) >= 7


@pytest.mark.parametrize("settings_cls", CLASSES, ids=lambda c: c.__name__)
def test_every_settings_class_has_a_command(settings_cls):
    assert any(issubclass(cmd.callback.settings_class, settings_cls) for cmd in COMMANDS.values())


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_every_field_but_the_secrets_is_a_flag_with_its_description(path):
    cmd = COMMANDS[path]
    settings_cls = cmd.callback.settings_class
    by_name = {p.name: p for p in cmd.params}
    opts = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    help_text = re.sub(r"\s+", "", result.output)
    for name, info in settings_cls.model_fields.items():
        if is_secret(info):
            assert name not in by_name and _flag(name) not in opts, f"secret {name} has a flag"
            continue
        assert info.description, f"{settings_cls.__name__}.{name} has no description"
        assert name in by_name and _flag(name) in by_name[name].opts, f"{' '.join(path)}: no {_flag(name)}"
        assert re.sub(r"\s+", "", info.description) in help_text, f"{_flag(name)}: description not in --help"
        assert env_name(settings_cls, name) in result.output


def test_secrets_are_environment_only():
    from dfp_api.settings import ApiSettings
    from dfp_generation.settings import GenerationSettings

    assert is_secret(ApiSettings.model_fields["api_keys"])
    assert is_secret(GenerationSettings.model_fields["openai_api_key"])
    assert not is_secret(GenerationSettings.model_fields["openai_endpoints"])  # names token variables, not tokens
    result = CliRunner().invoke(cli, ["api", "serve", "--api-keys", "[]"])
    assert result.exit_code == 2 and "No such option '--api-keys'" in result.output
    result = CliRunner().invoke(cli, ["generation", "worker", "--openai-api-key", "sk-x"])
    assert result.exit_code == 2 and "No such option '--openai-api-key'" in result.output


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_a_flag_wins_over_its_variable(path, monkeypatch):
    monkeypatch.setenv("DFLASH_LOG_LEVEL", "LOUD")
    monkeypatch.setenv("DFLASH_METRICS_PORT", "9100")
    result = _invoke(path, "--log-level", "INFO", "--metrics-port", "seventy")
    assert result.exit_code == 2, result.output
    assert "invalid configuration: --metrics-port: Input should be a valid integer" in result.output
    assert "LOG_LEVEL" not in result.output and "LOUD" not in result.output


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_a_bad_flag_reads_like_a_bad_variable(path, monkeypatch):
    monkeypatch.delenv("DFLASH_METRICS_PORT", raising=False)
    by_flag = _invoke(path, "--metrics-port", "seventy")
    monkeypatch.setenv("DFLASH_METRICS_PORT", "seventy")
    by_env = _invoke(path)
    assert by_flag.exit_code == by_env.exit_code == 2
    reason = re.compile(r"(--metrics-port|DFLASH_METRICS_PORT): ([^;\n]*)")
    assert "Error: invalid configuration: --metrics-port: " in by_flag.output
    assert "Error: invalid configuration: " in by_env.output
    assert reason.search(by_flag.output)[2] == reason.search(by_env.output)[2]


@click.command()
@with_settings(TargetSettings, "target")
def _show(settings: TargetSettings):
    click.echo(repr((settings.s3_region, settings.log_json, settings.layer_ids, settings.max_wait_ms)))


def test_flag_values_are_typed_by_their_fields(monkeypatch):
    monkeypatch.setenv("DFLASH_MODEL", "/m")
    monkeypatch.setenv("DFLASH_S3_REGION", "eu-west-1")
    monkeypatch.setenv("DFLASH_LOG_JSON", "true")
    monkeypatch.setenv("DFLASH_LAYER_IDS", "7")
    result = CliRunner().invoke(_show, ["--s3-region", "us-west-2", "--no-log-json", "--layer-ids", "1,3",
                                        "--max-wait-ms", "2.5", "--log-level", "WARNING"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == repr(("us-west-2", False, [1, 3], 2.5))
    result = CliRunner().invoke(_show, ["--log-level", "WARNING"])
    assert result.output.strip() == repr(("eu-west-1", True, [7], 2.0))


def test_old_flag_names_still_work(monkeypatch):
    monkeypatch.delenv("DFLASH_API_KEYS", raising=False)
    result = CliRunner().invoke(cli, ["api", "serve", "--auth-enabled", "--port", "0"])
    assert "DFLASH_API_KEYS" in result.output and "--port" in result.output  # auth stays on: keys are needed
    result = CliRunner().invoke(cli, ["generation", "worker", "--batch-size", "0"])
    assert "invalid configuration: --generation-batch-size: Input should be greater than or equal to 1" in result.output
    assert set(CommonSettings.model_fields) <= {p.name for p in COMMANDS[("tokenizer", "worker")].params}


def test_field_value_pairs():
    assert [parse_value(t) for t in ("200", "0.5", "true", "null", '"7"', "[1, 2]", '{"a": 1}')] == \
        [200, 0.5, True, None, "7", [1, 2], {"a": 1}]
    assert [parse_value(t) for t in ("[a, b]", "{a: 1}", "yes", "~")] == [["a", "b"], {"a": 1}, True, None]
    assert [parse_value(t) for t in ("", "s3://b/x", "Note: be brief", "2024-01-01", "012", "1:30")] == \
        ["", "s3://b/x", "Note: be brief", "2024-01-01", "012", "1:30"]
    spec = apply_assignments({"a": 1}, ["train.output=s3://b/d", "train.steps=5", " tokenize.thinking =false"])
    assert spec == {"a": 1, "train": {"output": "s3://b/d", "steps": 5}, "tokenize": {"thinking": False}}
    assert apply_assignments({}, ["lr=1e-3"], prefix="train") == {"train": {"lr": 1e-3}}
    with pytest.raises(click.BadParameter, match="expected FIELD=VALUE"):
        apply_assignments({}, ["steps"])
    with pytest.raises(click.BadParameter, match="a is not a mapping"):
        apply_assignments({"a": 1}, ["a.b=2"])


class _Kinds(CommonSettings):
    mode: Literal["fast", "exact"] = Field("fast", description="A choice.")
    where: Path = Field(Path("/tmp"), description="A path.")
    limits: dict[str, int] = Field(default_factory=dict, description="A JSON mapping.")
    token: SecretStr | None = Field(None, description="A credential.")


@click.command()
@with_settings(_Kinds, "test")
def _kinds(settings: _Kinds):
    click.echo(repr((settings.mode, settings.where, settings.limits)))


def test_flag_kinds_follow_the_annotations():
    params = {p.name: p for p in _kinds.params}
    assert isinstance(params["mode"].type, click.Choice) and list(params["mode"].type.choices) == ["fast", "exact"]
    assert params["where"].type.name == "path" and params["limits"].type.name == "json" and "token" not in params
    result = CliRunner().invoke(_kinds, ["--mode", "exact", "--where", "/srv", "--limits", '{"a": 2}',
                                         "--log-level", "WARNING"])
    assert result.output.strip() == repr(("exact", Path("/srv"), {"a": 2}))
    result = CliRunner().invoke(_kinds, ["--mode", "slow", "--limits", "[1]"])
    assert result.exit_code == 2 and "invalid configuration: --mode: Input should be 'fast' or 'exact'" in result.output
    assert "--limits: Input should be a valid dictionary" in result.output
