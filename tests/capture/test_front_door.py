"""The pass-through's front door is the API's: ``capture serve`` (the real command, in its own process, in front
of a real upstream) refuses a head over DFLASH_MAX_HEADER_BYTES or DFLASH_MAX_HEADERS with a 431 before anything
is forwarded, answers a head not complete within DFLASH_HEAD_TIMEOUT_S of its start with a 408 and closes,
closes an idle kept-alive connection after DFLASH_KEEP_ALIVE_TIMEOUT_S and a connection past
DFLASH_MAX_CONNECTIONS as it opens; and a client streaming a 100 MiB header in does not hold up another's
request."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import free_port, wait_for_port

from .conftest import LoopbackServer
from .fake_upstream import make_app

ROOT = Path(__file__).resolve().parents[2]
HEAD_TIMEOUT_S = 0.5
KEEP_ALIVE_S = 1.5
BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 16
HANG_GUARD_S = 10.0  # far past every limit above: only a server that never acts reaches it
CHAT = json.dumps({"model": "tiny-target", "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture(scope="module")
def upstream():
    server = LoopbackServer(make_app()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def port(upstream, tmp_path_factory):
    """``capture serve`` in front of ``upstream``, with small front-door limits; yields its port."""
    root = tmp_path_factory.mktemp("front-door")
    listen = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "services"), str(ROOT), env.get("PYTHONPATH", "")]),
               DFLASH_HEAD_TIMEOUT_S=str(HEAD_TIMEOUT_S), DFLASH_KEEP_ALIVE_TIMEOUT_S=str(KEEP_ALIVE_S),
               DFLASH_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
               DFLASH_MAX_CONNECTIONS=str(MAX_CONNECTIONS), DFLASH_LOG_LEVEL="WARNING")
    log = (root / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dfp_cli.main", "capture", "serve", "--upstream", upstream.url,
         "--capture-host", "127.0.0.1", "--capture-port", str(listen), "--storage-url", f"file://{root}"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(listen, timeout=60, process=proc)
        yield listen
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)


def _response(sock: socket.socket) -> bytes:
    """One whole response (head, then Content-Length bytes of body) read from ``sock``."""
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


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes ``sock`` (a reset after its answer counts as closing);
    fails if it is still open after the hang guard."""
    data = b""
    sock.settimeout(HANG_GUARD_S)
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _send_head(port: int, head: bytes) -> tuple[int, bytes]:
    """Send ``head`` (however large) on a new connection; (bytes the server took before it answered or closed,
    what it answered)."""
    sent = 0
    with _connect(port) as sock:
        with contextlib.suppress(OSError):  # the server answered and closed: the rest is never read
            while sent < len(head):
                sent += sock.send(head[sent:sent + 65536])
        return sent, _until_closed(sock)


def _chat_head(extra: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(CHAT))


def _refusals(port: int, reason: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=HANG_GUARD_S).text
    line = next((ln for ln in text.splitlines()
                 if ln.startswith(f'dfp_capture_refusals_total{{reason="{reason}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_huge_header_is_a_431_and_never_forwarded(port, upstream):
    before = _refusals(port, "request_head")
    seen = len(upstream.app.state.seen_headers)
    head = _chat_head(b"X-Big: " + b"a" * (8 * 2**20) + b"\r\n")
    sent, answer = _send_head(port, head + CHAT)
    assert answer.startswith(b"HTTP/1.1 431 ") and sent < len(head), (sent, answer[:200])
    assert "DFLASH_MAX_HEADER_BYTES" in json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
    assert len(upstream.app.state.seen_headers) == seen
    assert _refusals(port, "request_head") == before + 1
    with _connect(port) as sock:  # a head within the limits still goes through
        sock.sendall(_chat_head(b"Connection: close\r\n") + CHAT)
        assert _response(sock).startswith(b"HTTP/1.1 200 ")
    assert len(upstream.app.state.seen_headers) == seen + 1


def test_more_headers_than_allowed_is_a_431(port, upstream):
    seen = len(upstream.app.state.seen_headers)
    many = b"".join(b"X-H%d: 1\r\n" % i for i in range(150))
    sent, answer = _send_head(port, _chat_head(many) + CHAT)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert "DFLASH_MAX_HEADERS" in json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
    assert len(upstream.app.state.seen_headers) == seen


def test_a_silent_or_dribbling_connection_gets_a_408_and_is_closed(port):
    with _connect(port) as idle:
        answer = _until_closed(idle)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert "DFLASH_HEAD_TIMEOUT_S" in json.loads(answer.partition(b"\r\n\r\n")[2])["message"]

    # one byte at a time, each well inside the timeout: the head's time runs from its first byte
    head = _chat_head(b"X-Slow: " + b"a" * 200 + b"\r\n")
    with _connect(port) as dribble:
        with contextlib.suppress(OSError):
            for byte in head:
                dribble.sendall(bytes([byte]))
                time.sleep(HEAD_TIMEOUT_S / 5)
        answer = _until_closed(dribble)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]

    # the same on a kept-alive connection, for the head of its next request
    with _connect(port) as kept:
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _response(kept).startswith(b"HTTP/1.1 200 ")
        with contextlib.suppress(OSError):
            for byte in b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 200:
                kept.sendall(bytes([byte]))
                time.sleep(HEAD_TIMEOUT_S / 5)
        answer = _until_closed(kept)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_stalled_bodies_get_a_408_and_free_their_slots(port, upstream):
    """As many connections as the cap allows each send a whole head and one byte of a 1,000-byte body, then
    nothing: each gets a 408 once the body timeout passes, nothing is forwarded, and the next client is served."""
    seen = len(upstream.app.state.seen_headers)
    stalled = [_connect(port) for _ in range(MAX_CONNECTIONS - 1)]
    try:
        for sock in stalled:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n{")
        answers = [_until_closed(sock) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") and b"DFLASH_BODY_TIMEOUT_S" in a for a in answers), answers[0][:200]
    assert len(upstream.app.state.seen_headers) == seen
    with _connect(port) as ok:
        ok.sendall(_chat_head(b"Connection: close\r\n") + CHAT)
        assert _response(ok).startswith(b"HTTP/1.1 200 ")


def test_an_idle_kept_alive_connection_is_closed(port):
    with _connect(port) as kept:
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _response(kept).startswith(b"HTTP/1.1 200 ")
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")  # kept alive: a second request is served
        assert _response(kept).startswith(b"HTTP/1.1 200 ")
        # then nothing: closed without a word (the keep-alive timeout's, not the head timeout's 408)
        assert _until_closed(kept) == b""


def test_connections_past_the_cap_are_closed_as_they_open(port):
    held = [_connect(port) for _ in range(MAX_CONNECTIONS)]
    try:
        with _connect(port) as extra:
            assert _until_closed(extra) == b""  # closed unanswered: not the head timeout's 408
    finally:
        for sock in held:
            sock.close()
    time.sleep(HEAD_TIMEOUT_S)  # the server has seen them go
    with _connect(port) as ok:
        ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert _response(ok).startswith(b"HTTP/1.1 200 ")


def test_clients_streaming_100_mib_headers_do_not_hold_up_another(port, upstream):
    """One client after another streams a 100 MiB header in for as long as another makes its requests."""
    seen = len(upstream.app.state.seen_headers)
    attacks: list[tuple[int, bytes]] = []
    first, done = threading.Event(), threading.Event()

    def stream_huge_headers():
        chunk = b"a" * 65536
        while not done.is_set():
            sent = 0
            with _connect(port) as sock:
                with contextlib.suppress(OSError):
                    sock.sendall(_chat_head()[:-2] + b"X-Big: ")
                    first.set()
                    while sent < 100 * 2**20:
                        sock.sendall(chunk)
                        sent += len(chunk)
                attacks.append((sent, _until_closed(sock)))

    attacker = threading.Thread(target=stream_huge_headers, daemon=True)
    attacker.start()
    assert first.wait(HANG_GUARD_S)
    statuses = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
            for _ in range(10):
                statuses.append(http.post("/v1/chat/completions", content=CHAT,
                                          headers={"Content-Type": "application/json"}).status_code)
    finally:
        done.set()
        attacker.join(HANG_GUARD_S)
    assert not attacker.is_alive()
    assert statuses == [200] * 10
    assert len(upstream.app.state.seen_headers) == seen + 10  # the big ones were never forwarded
    # each was refused early: the server stopped reading long before its 100 MiB
    assert attacks and all(sent < 100 * 2**20 and answer.startswith(b"HTTP/1.1 431 ") for sent, answer in attacks), \
        [(sent, answer[:40]) for sent, answer in attacks]
