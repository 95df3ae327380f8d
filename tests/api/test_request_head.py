"""Request heads are limited in size and header count as they arrive (431), and /docs and /redoc, whose
pages load scripts from a CDN on the jobs page's origin, are off unless the operator turns them on."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from .conftest import WRITE_KEY, auth, served

GEN = {"type": "generate", "spec": {"prompts": "s3://bucket/prompts/", "output": "s3://bucket/out",
                                    "model": "file:///models/tiny"}}


def _small_limits():
    from dfp_api.server import ApiFrontDoor

    class Small(ApiFrontDoor):
        max_header_bytes = 4096
        max_headers = 20

    return Small


def _response(port: int, request: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and b"keep-alive" not in data.split(b"\r\n\r\n")[0].lower():
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), None)
                if length is not None and len(body) >= length:
                    break
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


def test_a_head_over_the_limits_is_a_431(make_app, redis_client):
    with served(make_app(), http=_small_limits()) as port:
        big = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n"
        status, body = _response(port, big)
        assert status == 431 and json.loads(body)["error"] == "headers_too_large"
        many = b"GET /healthz HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(30)) + b"\r\n"
        status, body = _response(port, many)
        assert status == 431 and "headers" in json.loads(body)["message"]
        # within the limits: served, and a body (however it arrives with the head) does not count as head
        assert _response(port, b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")[0] == 200
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            spec = {**GEN, "spec": {**GEN["spec"], "max_new_tokens": 64, "output": "s3://bucket/" + "o" * 100}}
            body = json.dumps(spec).encode() + b" " * 200_000  # trailing whitespace: still one JSON value
            resp = http.post("/v1/jobs", content=body, headers={**auth(WRITE_KEY), "Content-Type": "application/json"})
            assert resp.status_code == 201, resp.text
            assert 'dfp_api_refusals_total{reason="request_head"}' in http.get("/metrics").text


def test_a_64_mib_header_is_refused_quickly_and_others_are_served_meanwhile(make_app, redis_client):
    with served(make_app()) as port:
        took: list[float] = []

        def healthz_meanwhile():
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                for _ in range(20):
                    start = time.monotonic()
                    assert http.get("/healthz").status_code == 200
                    took.append(time.monotonic() - start)
                    time.sleep(0.02)

        other = threading.Thread(target=healthz_meanwhile)
        start = time.monotonic()
        answer, sent = b"", 0
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            other.start()
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: ")
            chunk = b"a" * 65536
            try:
                while sent < 64 * 2**20:
                    s.sendall(chunk)
                    sent += len(chunk)
                s.sendall(b"\r\n\r\n")
            except OSError:  # the server answered and closed: the rest was never read
                pass
            s.settimeout(10)
            try:
                while data := s.recv(65536):
                    answer += data
            except OSError:
                pass
        elapsed = time.monotonic() - start
        other.join(30)
        assert elapsed < 10, f"the 64 MiB header took {elapsed:.1f}s"
        # the server closed the connection long before the whole header was sent (or answered 431 first)
        assert sent < 64 * 2**20 or answer.startswith(b"HTTP/1.1 431"), (sent, answer[:100])
        assert not answer or answer.startswith(b"HTTP/1.1 431"), answer[:100]
        assert len(took) == 20 and max(took) < 5


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_docs_pages_are_off_by_default(make_app, redis_client, path):
    with TestClient(make_app()) as client:
        assert client.get(path).status_code == 404
        assert client.get("/openapi.json").status_code == 200
    with TestClient(make_app(api_docs=True)) as client:
        assert client.get(path).status_code == 200
