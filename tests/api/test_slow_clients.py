"""Slow and idle clients cannot hold the API's connections: a connection that sends nothing, or trickles half
a request head, gets a 408 and is closed once DFLASH_HEAD_TIMEOUT_S passes; connections past the process's
cap (DFLASH_MAX_CONNECTIONS, uvicorn's limit_concurrency) are closed as they open."""

from __future__ import annotations

import contextlib
import json
import socket
import time

from .conftest import served


def _protocol(timeout_s: float):
    from dfp_api.server import ApiFrontDoor

    class Quick(ApiFrontDoor):
        head_timeout_s = timeout_s

    return Quick


def _served(app, head_timeout_s: float, max_connections: int | None = None):
    """``app`` under uvicorn with the server's settings for the head timeout and the connection cap."""
    return served(app, http=_protocol(head_timeout_s), limit_concurrency=max_connections)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[float, bytes]:
    """(seconds until the server closed ``sock``, what it sent first); fails past ``seconds``."""
    started, data = time.monotonic(), b""
    sock.settimeout(seconds)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return time.monotonic() - started, data
        data += chunk


def _response(sock: socket.socket) -> bytes:
    """One whole HTTP response read from ``sock`` (its head, then Content-Length bytes of body): the server
    may write the head and the body in separate segments."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-body: {data!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def test_an_idle_or_trickling_connection_is_closed_after_the_head_timeout(make_app, redis_client):
    with _served(make_app(), head_timeout_s=1.0) as port:
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        took, sent = _closed_within(idle, 10)
        assert 0.5 < took < 5 and sent.startswith(b"HTTP/1.1 408 ")
        assert "DFLASH_HEAD_TIMEOUT_S" in json.loads(sent.partition(b"\r\n\r\n")[2])["message"]

        trickle = socket.create_connection(("127.0.0.1", port), timeout=10)
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for byte in b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 40:
                trickle.sendall(bytes([byte]))
                time.sleep(0.1)
        took, sent = _closed_within(trickle, 10)
        assert time.monotonic() - started < 5 and sent.startswith(b"HTTP/1.1 408 ")

        # a whole head in time is served, and the connection stays usable
        with socket.create_connection(("127.0.0.1", port), timeout=10) as ok:
            ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            assert _response(ok).startswith(b"HTTP/1.1 200 ")
            time.sleep(1.5)  # idle between requests: the keep-alive timeout's, not the head's
            ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            assert _response(ok).startswith(b"HTTP/1.1 200 ")


def test_connections_past_the_cap_are_closed_as_they_open(make_app, redis_client):
    with _served(make_app(), head_timeout_s=30.0, max_connections=4) as port:
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        took, sent = _closed_within(extra, 5)
        assert took < 2 and sent == b""
        for sock in held:
            sock.close()
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as ok:
            ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            assert _response(ok).startswith(b"HTTP/1.1 200 ")
