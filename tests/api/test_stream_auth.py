"""An open event stream re-checks its key at every poll: revocation, expiry and lost visibility end it."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from .conftest import READ_KEY, WRITE_KEY, auth
from .sse import read_events
from .test_key_reload import NEW_KEY, SecretVolume, entry

GEN = {"type": "generate", "spec": {"prompts": "s3://bucket/prompts/", "output": "s3://bucket/out",
                                    "model": "file:///models/tiny"}}
ADMIN_KEY = "dfp_test-admin-key-0123456789"
MAX_S = 8.0
"""The streams' own limit: a stream that outlives its key runs this long."""


@pytest.fixture
def volume(tmp_path):
    vol = SecretVolume(tmp_path)
    vol.write(json.dumps([entry("writer", WRITE_KEY), entry("reader", READ_KEY, ["read"]),
                          entry("root", ADMIN_KEY, ["admin"])]))
    return vol


def _watch(client, job_id: str, key: str, then=None, after_s: float = 0.5) -> tuple[list, float]:
    """The stream's events and how long it stayed open; ``then`` runs ``after_s`` into the stream."""
    timer = threading.Timer(after_s, then) if then else None
    start = time.monotonic()
    if timer:
        timer.start()
    try:
        events = read_events(client, job_id, headers=auth(key))
    finally:
        if timer:
            timer.cancel()
            timer.join()
    return events, time.monotonic() - start


def _submit(client, key: str = WRITE_KEY) -> str:
    resp = client.post("/v1/jobs", json=GEN, headers=auth(key))
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def _ended_unauthorized(events: list, elapsed: float, says: str) -> None:
    assert elapsed < MAX_S - 2, f"the stream outlived its key: open {elapsed:.1f}s"
    names = [e[0] for e in events]
    assert "end" not in names and names[-1] == "unauthorized", names
    data = events[-1][2]
    assert data["error"] == "unauthenticated" and says in data["message"], data
    assert WRITE_KEY not in json.dumps(data) and ADMIN_KEY not in json.dumps(data)


def test_a_revoked_key_s_open_stream_ends(make_app, redis_client, volume):
    with TestClient(make_app(api_keys=str(volume.path), sse_max_s=MAX_S)) as client:
        job_id = _submit(client)
        revoke = lambda: volume.write(json.dumps([entry("reader", READ_KEY, ["read"])]))  # noqa: E731
        events, elapsed = _watch(client, job_id, WRITE_KEY, then=revoke)
        _ended_unauthorized(events, elapsed, "no longer valid")
        assert any(e[0] == "progress" for e in events)  # it was streaming before
        assert client.get(f"/v1/jobs/{job_id}/events", headers=auth(WRITE_KEY)).status_code == 401


def test_an_open_stream_ends_when_the_key_set_stops_loading(make_app, redis_client, volume):
    with TestClient(make_app(api_keys=str(volume.path), sse_max_s=MAX_S)) as client:
        job_id = _submit(client)
        events, elapsed = _watch(client, job_id, WRITE_KEY, then=lambda: volume.write("[]"))
        _ended_unauthorized(events, elapsed, "could not be loaded")


def test_an_open_stream_ends_when_its_key_expires(make_app, redis_client):
    keys = json.dumps([entry("writer", WRITE_KEY, expires_at=time.time() + 2.0), entry("other", NEW_KEY)])
    with TestClient(make_app(api_keys=keys, sse_max_s=MAX_S)) as client:
        job_id = _submit(client)
        events, elapsed = _watch(client, job_id, WRITE_KEY)
        _ended_unauthorized(events, elapsed, "expired")


def test_an_open_stream_ends_when_its_key_may_no_longer_see_the_job(make_app, redis_client, volume):
    """An admin watching another principal's job, demoted to read: the job is no longer its to see."""
    with TestClient(make_app(api_keys=str(volume.path), sse_max_s=MAX_S)) as client:
        job_id = _submit(client)
        demote = lambda: volume.write(json.dumps([entry("writer", WRITE_KEY),  # noqa: E731
                                                  entry("root", ADMIN_KEY, ["read"])]))
        events, elapsed = _watch(client, job_id, ADMIN_KEY, then=demote)
        _ended_unauthorized(events, elapsed, "may no longer see")


def test_a_stream_whose_key_holds_runs_to_its_limit(make_app, redis_client, volume):
    """Unrelated changes to the key set do not end it; it closes at sse_max_s as before."""
    with TestClient(make_app(api_keys=str(volume.path), sse_max_s=2.0)) as client:
        job_id = _submit(client)
        add = lambda: volume.write(json.dumps([entry("writer", WRITE_KEY), entry("newcomer", NEW_KEY)]))  # noqa: E731
        events, elapsed = _watch(client, job_id, WRITE_KEY, then=add)
        assert elapsed >= 2.0
        assert [e[0] for e in events if e[0] in ("unauthorized", "end")] == []
        client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(WRITE_KEY))
        events, _ = _watch(client, job_id, WRITE_KEY)
        assert events[-1][0] == "end"
