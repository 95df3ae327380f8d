"""The key set reloads from its file without a restart; keys may expire."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from dfp_api.settings import ApiSettings
from dfp_shared.config import ConfigError, load_settings
from fastapi.testclient import TestClient

from .conftest import READ_KEY, WRITE_KEY, auth

NEW_KEY = "dfp_test-new-key-0123456789"


def entry(name: str, key: str, scopes=("read", "write"), **extra) -> dict:
    return {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest(), "scopes": list(scopes), **extra}


class SecretVolume:
    """A directory laid out as the kubelet mounts a Secret: ``keys -> ..data/keys``, where ``..data``
    is a symlink to a timestamped directory that an update replaces by swapping the link."""

    def __init__(self, root):
        self.root = root
        self.version = 0
        self.path = root / "keys"

    def write(self, text: str) -> None:
        self.version += 1
        target = self.root / f"..v{self.version}"
        target.mkdir()
        (target / "keys").write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(target.name)
        os.replace(tmp, self.root / "..data")
        if not self.path.is_symlink():
            self.path.symlink_to("..data/keys")


def _status_within(client, key: str, wanted: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        status = client.get("/v1/jobs", headers=auth(key)).status_code
        if status == wanted or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


@pytest.fixture
def volume(tmp_path):
    vol = SecretVolume(tmp_path)
    vol.write(json.dumps([entry("writer", WRITE_KEY), entry("reader", READ_KEY, ["read"])]))
    return vol


def test_a_key_removed_from_the_mounted_secret_is_refused_without_restart(make_app, redis_client, volume):
    with TestClient(make_app(api_keys=str(volume.path))) as client:
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200
        assert client.get("/v1/jobs", headers=auth(NEW_KEY)).status_code == 401
        volume.write(json.dumps([entry("reader", READ_KEY, ["read"]), entry("newcomer", NEW_KEY)]))
        assert _status_within(client, WRITE_KEY, 401) == 401
        revoked = client.get("/v1/jobs", headers=auth(WRITE_KEY))
        assert revoked.json()["error"] == "unauthenticated"
        assert _status_within(client, NEW_KEY, 200) == 200
        assert client.get("/v1/jobs", headers=auth(READ_KEY)).status_code == 200


def test_a_key_file_edited_in_place_reloads_too(make_app, redis_client, tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([entry("writer", WRITE_KEY)]))
    with TestClient(make_app(api_keys=str(path))) as client:
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200
        path.write_text(json.dumps([entry("newcomer", NEW_KEY)]))
        assert _status_within(client, NEW_KEY, 200) == 200
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 401


UNLOADABLE = "the API key set could not be loaded; ask the operator"


def _problems(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and "API key" in r.getMessage()]


def _refused_as_unloadable(client, key: str) -> None:
    resp = client.get("/v1/jobs", headers=auth(key))
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"] == "unauthenticated" and resp.json()["message"] == UNLOADABLE
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("bad,reason", [
    ("[]", "empty"),
    ("", "empty"),
    (json.dumps([entry("reader", READ_KEY, ["read", "wirte"])]), "entry 0.scopes"),
    (json.dumps([{"name": "x", "sha256": "abc"}]), "entry 0.sha256"),
    ("[{not yaml", "not valid JSON/YAML"),
    (json.dumps([entry("anonymous", NEW_KEY)]), "reserved"),
])
def test_a_key_file_that_becomes_invalid_fails_closed_and_logs_why(make_app, redis_client, volume, caplog,
                                                                   bad, reason):
    """The revoked writer key is gone from the new file, but the file does not load: no key works
    (keeping the last good set would leave the revoked key working)."""
    caplog.set_level(logging.ERROR, logger="dfp_api")
    with TestClient(make_app(api_keys=str(volume.path))) as client:
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200
        volume.write(bad)
        assert _status_within(client, WRITE_KEY, 401) == 401
        _refused_as_unloadable(client, WRITE_KEY)
        _refused_as_unloadable(client, READ_KEY)
        assert client.get("/v1/jobs", headers=auth(NEW_KEY)).status_code == 401
        problem = _problems(caplog)[-1]
        text = problem.getMessage() + " " + str(vars(problem))
        assert str(volume.path) in text and reason in text, text
        assert WRITE_KEY not in text and READ_KEY not in text
        # a valid file again restores service
        volume.write(json.dumps([entry("reader", READ_KEY, ["read"]), entry("newcomer", NEW_KEY)]))
        assert _status_within(client, NEW_KEY, 200) == 200
        assert client.get("/v1/jobs", headers=auth(READ_KEY)).status_code == 200
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 401


def test_a_key_file_that_disappears_fails_closed_until_it_returns(make_app, redis_client, volume, caplog):
    caplog.set_level(logging.ERROR, logger="dfp_api")
    with TestClient(make_app(api_keys=str(volume.path))) as client:
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200
        volume.path.unlink()
        assert _status_within(client, WRITE_KEY, 401) == 401
        _refused_as_unloadable(client, WRITE_KEY)
        _refused_as_unloadable(client, READ_KEY)
        problem = _problems(caplog)[-1]
        text = problem.getMessage() + " " + str(vars(problem))
        assert str(volume.path) in text and "No such file" in text, text
        # logged once, not on every request
        for _ in range(3):
            _refused_as_unloadable(client, WRITE_KEY)
            time.sleep(0.4)
        assert len(_problems(caplog)) == 1
        volume.path.symlink_to("..data/keys")
        volume.write(json.dumps([entry("newcomer", NEW_KEY)]))
        assert _status_within(client, NEW_KEY, 200) == 200
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 401
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).json()["message"] == "invalid API key"


def test_an_expired_key_is_refused_saying_it_expired(make_app, redis_client):
    past = (datetime.now(timezone.utc) - timedelta(hours=1)).isoformat()
    keys = json.dumps([entry("old", WRITE_KEY, expires_at=past), entry("older", READ_KEY, expires_at=1_000_000_000),
                       entry("fresh", NEW_KEY, expires_at=int(time.time()) + 3600)])
    with TestClient(make_app(api_keys=keys)) as client:
        for key in (WRITE_KEY, READ_KEY):
            resp = client.get("/v1/jobs", headers=auth(key))
            assert resp.status_code == 401, resp.text
            assert resp.json()["error"] == "unauthenticated" and "expired" in resp.json()["message"]
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        assert "2001-09-09" in client.get("/v1/jobs", headers=auth(READ_KEY)).json()["message"]
        assert client.get("/v1/jobs", headers=auth(NEW_KEY)).status_code == 200


def test_a_key_expires_while_the_server_runs(make_app, redis_client):
    soon = time.time() + 1.5
    with TestClient(make_app(api_keys=json.dumps([entry("brief", WRITE_KEY, expires_at=soon)]))) as client:
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200
        assert _status_within(client, WRITE_KEY, 401) == 401
        assert "expired" in client.get("/v1/jobs", headers=auth(WRITE_KEY)).json()["message"]


def test_bad_expiry_names_the_entry_and_field(monkeypatch):
    monkeypatch.delenv("DFLASH_API_KEYS", raising=False)
    bad = json.dumps([entry("x", WRITE_KEY, expires_at="next tuesday")])
    with pytest.raises(ConfigError, match=r"entry 0\.expires_at"):
        load_settings(ApiSettings, api_keys=bad)
    iso = json.dumps([entry("x", WRITE_KEY, expires_at="2030-01-01T00:00:00Z")])
    assert load_settings(ApiSettings, api_keys=iso).api_keys == iso


@pytest.mark.parametrize("name", ["anonymous", "Anonymous", "ANONYMOUS"])
def test_the_name_anonymous_is_reserved(monkeypatch, tmp_path, name):
    """``anonymous`` owns the jobs created with auth disabled and ownerless outputs: no key may hold it."""
    from dfp_api.auth import parse_keys
    from dfp_api.cli import group

    monkeypatch.delenv("DFLASH_API_KEYS", raising=False)
    keys = json.dumps([entry("writer", WRITE_KEY), entry(name, NEW_KEY)])
    with pytest.raises(ValueError, match=r"entry 1\.name.*reserved"):
        parse_keys(keys)
    with pytest.raises(ConfigError, match="reserved"):
        load_settings(ApiSettings, api_keys=keys)
    path = tmp_path / "keys.json"
    path.write_text(keys)
    with pytest.raises(ConfigError, match="reserved"):
        load_settings(ApiSettings, api_keys=str(path))
    out = CliRunner().invoke(group, ["new-key", "--name", name])
    assert out.exit_code != 0 and "reserved" in out.output and "dfp_" not in out.output


def test_new_key_takes_an_expiry_and_the_admin_scope():
    from dfp_api.auth import KeyRing, parse_keys
    from dfp_api.cli import group

    runner = CliRunner()
    out = runner.invoke(group, ["new-key", "--name", "ci", "--scope", "admin", "--expires-at", "2030-01-01T00:00:00Z"])
    assert out.exit_code == 0, out.output
    lines = dict(line.split(":", 1) for line in out.output.splitlines() if ":" in line)
    key, made = lines["key"].strip(), json.loads(lines["entry"])
    assert made["scopes"] == ["admin"] and made["expires_at"].startswith("2030-01-01T00:00:00")
    principal = KeyRing(parse_keys(json.dumps([made]))).authenticate(key)
    assert principal is not None and principal.name == "ci" and principal.allows("write")
    unix = runner.invoke(group, ["new-key", "--name", "ci", "--expires-at", "1893456000"])
    assert json.loads(unix.output.split("entry:", 1)[1])["expires_at"].startswith("2030-01-01T00:00:00")
    bad = runner.invoke(group, ["new-key", "--name", "ci", "--expires-at", "soon"])
    assert bad.exit_code != 0 and "--expires-at" in bad.output
