"""A client that stops reading its reply holds no upstream connection: once a piece of the reply has waited
``DFLASH_CAPTURE_SEND_TIMEOUT_S`` for it, its connection is cut, the upstream's is released, and every other
client is served (a pass-through with two upstream connections, two clients that never read 16 MiB replies)."""

from __future__ import annotations

import json
import socket

import httpx
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from .conftest import LoopbackServer, counter

BIG = 16 * 1024 * 1024
HANG_GUARD_S = 30.0


def big_upstream() -> Starlette:
    async def chat(request):
        await request.body()
        return Response(b"x" * BIG, media_type="application/json")

    async def health(request):
        return Response(b"")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])


def test_clients_that_stop_reading_free_their_upstream_connections(capture):
    upstream = LoopbackServer(big_upstream()).start()
    try:
        proxy = capture(capture_upstream=upstream.url, capture_max_connections=2, capture_send_timeout_s=0.5,
                        capture_connect_timeout_s=HANG_GUARD_S)
        before = counter("dfp_capture_requests_total", route="chat", outcome="client_stalled")
        port = int(proxy.url.rsplit(":", 1)[1])
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        readers = []
        for _ in range(2):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            readers.append(sock)  # never read
        try:
            # both upstream connections are held by the readers; this one waits for a slot and gets one
            reply = httpx.post(proxy.url + "/v1/chat/completions", content=body, timeout=HANG_GUARD_S)
            assert reply.status_code == 200 and len(reply.content) == BIG
        finally:
            for sock in readers:
                sock.close()
        assert counter("dfp_capture_requests_total", route="chat", outcome="client_stalled") - before == 2
    finally:
        upstream.stop()
