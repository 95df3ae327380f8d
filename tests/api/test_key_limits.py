"""One key cannot take the API from the others: open event streams and queued + running jobs per key,
a pool of their own for event streams, /readyz on connections of its own, refusals counted."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from .conftest import READ_KEY, WRITE_KEY, auth, served
from .test_key_reload import entry

GEN = {"type": "generate", "spec": {"prompts": "s3://bucket/prompts/", "output": "s3://bucket/out",
                                    "model": "file:///models/tiny"}}
OTHER_KEY = "dfp_test-other-writer-0123456789"


@pytest.fixture
def keys():
    return json.dumps([entry("writer", WRITE_KEY), entry("reader", READ_KEY, ["read"]), entry("other", OTHER_KEY)])


def _open_stream(port: int, key: str, job_id: str) -> tuple[socket.socket, int, bytes]:
    """A raw event-stream request, left open: (socket, status, what came with the head)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.sendall(f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(65536)
        if not chunk:
            break
        head += chunk
    return s, int(head.split(b" ", 2)[1]), head


def _body_of(s: socket.socket, head: bytes) -> dict:
    header, _, body = head.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in header.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(65536)
    return json.loads(body[:length])


def _header(head: bytes, name: str) -> str | None:
    for line in head.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name.lower().encode():
            return v.strip().decode()
    return None


def test_one_key_s_event_streams_stop_at_its_limit_and_leave_other_keys_alone(make_app, redis_client, keys):
    app = make_app(api_keys=keys, max_streams_per_key=3, sse_poll_s=0.5)
    with served(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        job_id = http.post("/v1/jobs", json=GEN, headers=auth(WRITE_KEY)).json()["id"]
        other_id = http.post("/v1/jobs", json=GEN, headers=auth(OTHER_KEY)).json()["id"]
        opened = [_open_stream(port, WRITE_KEY, job_id) for _ in range(3)]
        try:
            assert [status for _, status, _ in opened] == [200, 200, 200]
            s, status, head = _open_stream(port, WRITE_KEY, job_id)
            with s:
                assert status == 429, head
                assert int(_header(head, "Retry-After")) >= 1
                body = _body_of(s, head)
            assert body["error"] == "event_streams"
            assert body["usage"] == {"event_streams": 3, "limit": 3}
            # the other key's streams and requests, and readiness, are untouched
            s2, status2, _ = _open_stream(port, OTHER_KEY, other_id)
            s2.close()
            assert status2 == 200
            assert http.get("/v1/jobs", headers=auth(READ_KEY)).status_code == 200
            assert http.get("/readyz").status_code == 200
            metrics = http.get("/metrics").text
            assert 'dfp_api_refusals_total{reason="event_streams"}' in metrics
        finally:
            for s, _, _ in opened:
                s.close()
        # a closed stream gives its place back
        deadline = time.monotonic() + 10
        while True:
            s, status, _ = _open_stream(port, WRITE_KEY, job_id)
            s.close()
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 200


def test_event_streams_never_take_the_request_path_s_redis_connections(make_app, redis_client, keys):
    """More open streams than the request path's pool holds: other keys' requests and /readyz still answer."""
    app = make_app(api_keys=keys, max_streams_per_key=0, max_event_streams=400, sse_poll_s=2.0)
    with served(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20) as http:
        job_id = http.post("/v1/jobs", json=GEN, headers=auth(WRITE_KEY)).json()["id"]
        opened = []
        try:
            for _ in range(300):
                opened.append(_open_stream(port, WRITE_KEY, job_id))
            assert {status for _, status, _ in opened} == {200}
            time.sleep(0.5)  # every stream now waits on Redis
            assert http.get("/readyz").status_code == 200
            assert http.get("/v1/jobs", headers=auth(READ_KEY)).status_code == 200
            assert http.get(f"/v1/jobs/{job_id}", headers=auth(WRITE_KEY)).status_code == 200
            assert http.post("/v1/jobs", json=GEN, headers=auth(OTHER_KEY)).status_code == 201
        finally:
            for s, _, _ in opened:
                s.close()


def test_queued_and_running_jobs_per_key(make_app, redis_client, keys):
    with TestClient(make_app(api_keys=keys, max_active_jobs_per_key=2)) as client:
        first = [client.post("/v1/jobs", json=GEN, headers=auth(WRITE_KEY)) for _ in range(2)]
        assert [r.status_code for r in first] == [201, 201]
        refused = client.post("/v1/jobs", json=GEN, headers=auth(WRITE_KEY))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"] == "active_jobs"
        assert refused.json()["usage"] == {"active_jobs": 2, "limit": 2}
        # a replay of a job already made is never refused
        again = client.post("/v1/jobs", json=GEN, headers={**auth(WRITE_KEY), "Idempotency-Key": "k1"})
        assert again.status_code == 429
        # another key is untouched
        assert client.post("/v1/jobs", json=GEN, headers=auth(OTHER_KEY)).status_code == 201
        # a job that ends frees its place
        assert client.post(f"/v1/jobs/{first[0].json()['id']}/cancel", headers=auth(WRITE_KEY)).status_code == 200
        assert client.post("/v1/jobs", json=GEN, headers=auth(WRITE_KEY)).status_code == 201
        assert 'dfp_api_refusals_total{reason="active_jobs"}' in client.get("/metrics").text


def test_concurrent_submits_never_pass_the_job_limit_together(make_app, redis_client, keys):
    from concurrent.futures import ThreadPoolExecutor

    with TestClient(make_app(api_keys=keys, max_active_jobs_per_key=3)) as client:
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: client.post("/v1/jobs", json=GEN, headers=auth(WRITE_KEY)).status_code,
                                  range(12)))
    assert sorted(codes) == [201] * 3 + [429] * 9


def test_a_rate_limited_key_is_told_its_usage(make_app, redis_client, keys):
    with TestClient(make_app(api_keys=keys, rate_limit_per_s=0.5, rate_limit_burst=2)) as client:
        codes = [client.get("/v1/jobs", headers=auth(WRITE_KEY)) for _ in range(3)]
        limited = codes[-1]
        assert limited.status_code == 429
        assert limited.json()["usage"]["burst"] == 2 and limited.json()["usage"]["remaining"] == 0
        assert client.get("/v1/jobs", headers=auth(OTHER_KEY)).status_code == 200
        assert 'dfp_api_refusals_total{reason="rate_limited"}' in client.get("/metrics").text
