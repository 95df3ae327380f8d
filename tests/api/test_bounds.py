"""Request bounds: a body limit enforced on the stream, list pages without specs, and a schema that
states what validation enforces."""

from __future__ import annotations

import json
import socket
import time

import pytest
from dfp_api.settings import ApiSettings
from fastapi.testclient import TestClient

from .conftest import WRITE_KEY, auth, served

GEN_SPEC = {"prompts": "file:///data/prompts.jsonl", "output": "file:///data/out", "model": "file:///models/tiny"}
LIMIT = 64 * 1024


@pytest.fixture
def server(make_app, redis_client):
    """The app under a real uvicorn (httptools, as served) on a free port, with a 64 KiB body limit."""
    with served(make_app(max_body_bytes=LIMIT)) as port:
        yield port


def _request(port: int, head: str, body_parts: list[bytes], pause_s: float = 0.0) -> tuple[int, dict, bytes]:
    """Send a raw HTTP/1.1 request (body sent part by part; the server may answer before it all arrived)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode())
        try:
            for part in body_parts:
                sock.sendall(part)
                if pause_s:
                    time.sleep(pause_s)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the whole body was sent
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if "content-length" in headers:
            while len(rest) < int(headers["content-length"]):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
        return status, headers, rest


def _head(port: int, extra: str) -> str:
    return (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {WRITE_KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n")


def _padded(size: int) -> bytes:
    """A valid job request padded with whitespace to ``size`` bytes (valid JSON, accepted if not for its size)."""
    body = json.dumps({"type": "generate", "spec": GEN_SPEC}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def test_a_body_over_the_limit_with_content_length_is_413_and_nothing_is_stored(server, redis_client):
    body = _padded(LIMIT + 1)
    status, headers, payload = _request(server, _head(server, f"Content-Length: {len(body)}\r\n"), [body])
    assert status == 413, payload
    error = json.loads(payload)
    assert error["error"] == "payload_too_large" and str(LIMIT) in error["message"]
    assert headers["content-type"] == "application/json"
    assert redis_client.zcard("dfp:jobs") == 0 and not redis_client.keys("dfp:job:*")


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read(server, redis_client):
    # only the head is sent: the answer must come without the server waiting for 100 MB
    status, _, payload = _request(server, _head(server, f"Content-Length: {100 * 1024 * 1024}\r\n"), [])
    assert status == 413 and json.loads(payload)["error"] == "payload_too_large"


def test_a_chunked_body_over_the_limit_is_413_and_nothing_is_stored(server, redis_client):
    body = _padded(4 * LIMIT)
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + 8192]), body[i:i + 8192]) for i in range(0, len(body), 8192)]
    status, _, payload = _request(server, _head(server, "Transfer-Encoding: chunked\r\n"), parts + [b"0\r\n\r\n"])
    assert status == 413, payload
    assert json.loads(payload)["error"] == "payload_too_large"
    assert redis_client.zcard("dfp:jobs") == 0


def test_bodies_within_the_limit_are_accepted_chunked_or_not(server, redis_client):
    body = _padded(LIMIT - 10)
    status, _, payload = _request(server, _head(server, f"Content-Length: {len(body)}\r\n"), [body])
    assert status == 201, payload
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + 4096]), body[i:i + 4096]) for i in range(0, len(body), 4096)]
    status, _, payload = _request(server, _head(server, "Transfer-Encoding: chunked\r\n"), parts + [b"0\r\n\r\n"])
    assert status == 201, payload
    assert redis_client.zcard("dfp:jobs") == 2


def test_the_body_limit_is_a_setting_with_a_1_mib_default(monkeypatch):
    from .conftest import key_entries

    assert ApiSettings(api_keys=key_entries()).max_body_bytes == 1024 * 1024
    monkeypatch.setenv("DFLASH_MAX_BODY_BYTES", "2048")
    assert ApiSettings(api_keys=key_entries()).max_body_bytes == 2048


def test_list_items_leave_the_spec_out_and_the_single_get_keeps_it(api, redis_client):
    from dfp_shared.jobs.store import JobStore

    big = {**GEN_SPEC, "notes": "m" * 200_000}  # as big as a spec stored before bounds existed
    ids = [JobStore(redis_client).create("generate", big, owner="writer")[0].id for _ in range(5)]
    listed = api.get("/v1/jobs", params={"limit": 50})
    assert listed.status_code == 200
    assert len(listed.content) < 50_000, len(listed.content)
    items = listed.json()["items"]
    assert {j["id"] for j in items} == set(ids)
    assert all("spec" not in j for j in items)
    assert all(j["owner"] == "writer" and j["state"] == "queued" and "progress" in j for j in items)
    one = api.get(f"/v1/jobs/{ids[0]}").json()
    assert one["spec"]["notes"] == "m" * 200_000


def test_the_schema_states_the_page_size_the_server_enforces(make_app, redis_client):
    with TestClient(make_app(max_page_size=120), headers=auth(WRITE_KEY)) as client:
        doc = client.get("/openapi.json").json()
        params = {p["name"]: p for p in doc["paths"]["/v1/jobs"]["get"]["parameters"]}
        assert params["limit"]["schema"]["maximum"] == 120
        assert client.get("/v1/jobs", params={"limit": 120}).status_code == 200
        assert client.get("/v1/jobs", params={"limit": 121}).status_code == 422


def test_headers_are_never_nullable_in_the_schema(api):
    doc = api.get("/openapi.json").json()
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            for param in operation.get("parameters", []):
                if param["in"] == "header":
                    assert "anyOf" not in param["schema"] and param["schema"].get("type") == "string", (path, param)


def test_the_schema_states_that_the_transformers_engine_needs_a_model(api):
    from jsonschema import Draft202012Validator

    doc = api.get("/openapi.json").json()
    schema = {**doc["components"]["schemas"]["GenerateSpec"], "components": doc["components"]}
    check = Draft202012Validator(schema).is_valid
    base = {"prompts": "file:///p.jsonl", "output": "file:///o"}
    assert not check(base)
    assert not check({**base, "engine": "transformers"})
    assert not check({**base, "engine": "transformers", "model": None})
    assert check({**base, "model": "file:///m"})
    assert check({**base, "engine": "openai"})
    assert api.post("/v1/jobs", json={"type": "generate", "spec": base}).status_code == 422
