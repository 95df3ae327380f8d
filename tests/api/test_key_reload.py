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
        assert _status_within(client, WRITE_KEY, 401) == 401
        assert client.get("/v1/jobs", headers=auth(NEW_KEY)).status_code == 200


def test_an_invalid_key_file_keeps_the_last_good_set_and_logs_why(make_app, redis_client, volume, caplog):
    caplog.set_level(logging.ERROR, logger="dfp_api")
    with TestClient(make_app(api_keys=str(volume.path))) as client:
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200
        volume.write(json.dumps([{"name": "x", "sha256": "abc"}]))
        deadline = time.monotonic() + 10
        while not any("keys" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200
            time.sleep(0.1)
        problem = next(r for r in caplog.records if "keys" in r.getMessage())
        text = problem.getMessage() + " " + str(vars(problem))
        assert str(volume.path) in text and "entry 0.sha256" in text
        assert WRITE_KEY not in text
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200
        assert client.get("/v1/jobs", headers=auth(READ_KEY)).status_code == 200
        # a file that disappears keeps the last good set too
        volume.path.unlink()
        time.sleep(1.2)
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200
        # and a good file again takes effect
        volume.path.symlink_to("..data/keys")
        volume.write(json.dumps([entry("newcomer", NEW_KEY)]))
        assert _status_within(client, NEW_KEY, 200) == 200
        assert client.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 401


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
