"""Authentication, scopes, rate limits and secret hygiene of the API."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
from dfp_api.settings import ApiSettings
from dfp_shared.config import ConfigError, load_settings
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from fastapi.testclient import TestClient

from .conftest import READ_KEY, WRITE_KEY, auth, key_entries

GEN = {"type": "generate", "spec": {"prompts": "file:///data/prompts.jsonl", "output": "file:///data/out",
                                    "model": "file:///models/tiny"}}


@pytest.fixture
def anon(make_app, redis_client):
    with TestClient(make_app()) as client:
        yield client


def test_missing_and_wrong_keys_are_401(anon):
    for headers in ({}, auth("not-a-key"), {"Authorization": "Basic dXNlcjpwYXNz"}, auth("")):
        for method, path in (("GET", "/v1/jobs"), ("GET", "/v1/jobs/abc"), ("POST", "/v1/jobs/abc/cancel"),
                             ("GET", "/v1/jobs/abc/events")):
            resp = anon.request(method, path, headers=headers)
            assert resp.status_code == 401, (method, path, headers, resp.text)
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            assert resp.json()["error"] == "unauthenticated"
    assert anon.post("/v1/jobs", json=GEN).status_code == 401
    # health and metrics stay open for probes and scrapers
    assert anon.get("/healthz").status_code == 200
    assert anon.get("/readyz").json() == {"status": "ok", "checks": {"redis": "ok"}}
    assert anon.get("/metrics").status_code == 200


def test_read_only_key_lists_and_watches_but_cannot_write(anon, redis_client):
    # a job of the read-only key's own principal (made as another service of its holder would)
    job_id = queue_job(redis_client, "generate", GEN["spec"], owner="reader")[0].id
    reader = auth(READ_KEY)
    assert anon.get("/v1/jobs", headers=reader).json()["total"] == 1
    assert anon.get(f"/v1/jobs/{job_id}", headers=reader).json()["state"] == "queued"
    denied = anon.post("/v1/jobs", json=GEN, headers=reader)
    assert denied.status_code == 403 and "write" in denied.json()["message"]
    assert anon.post(f"/v1/jobs/{job_id}/cancel", headers=reader).status_code == 403
    assert anon.post(f"/v1/jobs/{job_id}/cancel", headers=auth(WRITE_KEY)).status_code == 404  # not its job
    JobStore(redis_client).cancel(job_id)
    with anon.stream("GET", f"/v1/jobs/{job_id}/events", headers=reader) as stream:
        assert stream.status_code == 200
        body = stream.read().decode()
    assert "event: end" in body and '"cancelled"' in body


def test_rate_limit_is_per_key_and_shared_by_replicas(make_app, redis_client):
    with TestClient(make_app(rate_limit_per_s=0.5, rate_limit_burst=3)) as a, \
         TestClient(make_app(rate_limit_per_s=0.5, rate_limit_burst=3)) as b:
        codes = [a.get("/v1/jobs", headers=auth(READ_KEY)).status_code for _ in range(2)]
        codes.append(b.get("/v1/jobs", headers=auth(READ_KEY)).status_code)
        assert codes == [200, 200, 200]
        limited = b.get("/v1/jobs", headers=auth(READ_KEY))
        assert limited.status_code == 429
        assert int(limited.headers["Retry-After"]) >= 1
        assert limited.json()["error"] == "rate_limited"
        assert a.get("/v1/jobs", headers=auth(READ_KEY)).status_code == 429
        # another key has its own bucket
        assert a.get("/v1/jobs", headers=auth(WRITE_KEY)).status_code == 200


def test_no_key_in_responses_or_logs(anon, caplog):
    caplog.set_level(logging.DEBUG)
    texts = [anon.post("/v1/jobs", json=GEN, headers=auth(WRITE_KEY)).text,
             anon.get("/v1/jobs", headers=auth(READ_KEY)).text,
             anon.get("/v1/jobs", headers=auth(WRITE_KEY + "x")).text,
             anon.post("/v1/jobs", json=GEN, headers=auth(READ_KEY)).text,
             anon.get("/openapi.json").text, anon.get("/metrics").text]
    records = [str(vars(rec)) for rec in caplog.records]
    for text in texts + [caplog.text] + records:
        assert WRITE_KEY not in text and READ_KEY not in text
    assert any(getattr(rec, "caller", None) == "writer" for rec in caplog.records)  # logged by key name


def test_key_configuration_errors_name_the_setting(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_API_KEYS", raising=False)
    monkeypatch.delenv("DFLASH_AUTH_DISABLED", raising=False)
    with pytest.raises(ConfigError, match="DFLASH_API_KEYS: .*no API keys configured"):
        load_settings(ApiSettings)
    bad = json.dumps([{"name": "x", "sha256": "abc", "scopes": ["read"]}])
    with pytest.raises(ConfigError, match=r"DFLASH_API_KEYS: .*entry 0\.sha256"):
        load_settings(ApiSettings, api_keys=bad)
    bad_scope = json.dumps([{"name": "x", "sha256": "a" * 64, "scopes": ["root"]}])
    with pytest.raises(ConfigError, match="unknown scope"):
        load_settings(ApiSettings, api_keys=bad_scope)
    with pytest.raises(ConfigError, match="neither a JSON list of keys nor a readable file"):
        load_settings(ApiSettings, api_keys="/no/such/keys.json")
    path = tmp_path / "keys.yaml"
    path.write_text(f"- name: ci\n  sha256: {hashlib.sha256(b'k').hexdigest()}\n  scopes: [read]\n")
    assert load_settings(ApiSettings, api_keys=str(path)).api_keys == str(path)
    assert load_settings(ApiSettings, auth_disabled=True).api_keys is None
    assert load_settings(ApiSettings, api_keys=key_entries()).rate_limit_per_s > 0


def test_auth_disabled_gives_every_caller_all_scopes(make_app, redis_client):
    with TestClient(make_app(api_keys=None, auth_disabled=True)) as client:
        created = client.post("/v1/jobs", json=GEN)
        assert created.status_code == 201
        assert client.post(f"/v1/jobs/{created.json()['id']}/cancel").json()["state"] == "cancelled"


def test_leased_tokens_never_exceed_the_shared_bucket(redis_server, redis_client):
    import asyncio

    import redis.asyncio as aioredis
    from dfp_api.ratelimit import RateLimiter

    async def run() -> list[bool]:
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        replicas = [RateLimiter(client, rate_per_s=0.01, burst=10, lease=4) for _ in range(3)]
        decisions = [await replicas[i % 3].hit("ci") for i in range(30)]
        await client.aclose()
        return [d.allowed for d in decisions]

    allowed = asyncio.run(run())
    assert sum(allowed) == 10  # the burst, split across replicas in leases, and not one more
    assert allowed[:3] == [True, True, True] and not any(allowed[12:])
