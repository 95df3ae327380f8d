from __future__ import annotations

import subprocess
import sys

import pytest
from dfp_shared.config import CommonSettings, ConfigError, load_settings

from tests.support.cli import cli_env


def test_env_and_flags(monkeypatch):
    monkeypatch.setenv("DFLASH_REDIS_URL", "redis://example:6380/1")
    monkeypatch.setenv("DFLASH_METRICS_PORT", "9100")
    s = load_settings(CommonSettings, metrics_port=9200, log_level=None)
    assert s.redis_url == "redis://example:6380/1"
    assert s.metrics_port == 9200  # the flag wins over the environment


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("DFLASH_METRICS_PORT", "seventy")
    with pytest.raises(ConfigError, match="DFLASH_METRICS_PORT"):
        load_settings(CommonSettings)


def test_bad_flag_names_the_flag():
    with pytest.raises(ConfigError, match="--log-level"):
        load_settings(CommonSettings, log_level="LOUD")


def test_cli_help_lists_every_service():
    out = subprocess.run([sys.executable, "-m", "dfp_cli.main", "--help"], capture_output=True, text=True,
                         env=cli_env(), check=True).stdout
    for name in ("api", "generation", "tokenizer", "target", "trainer", "capture", "demo", "submit"):
        assert name in out


def test_a_bad_secret_is_named_but_never_echoed(monkeypatch):
    from dfp_api.settings import ApiSettings

    monkeypatch.setenv("DFLASH_API_KEYS", '[{"name": "ci", "sha256": "not-a-digest-s3cr3t-marker"}]')
    with pytest.raises(ConfigError, match="DFLASH_API_KEYS") as exc:
        load_settings(ApiSettings)
    assert "s3cr3t-marker" not in str(exc.value)
