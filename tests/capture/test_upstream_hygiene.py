"""An upstream connection never hands one request's bytes to another, and no request is sent twice: hostile
upstreams (stray replies after a complete one, bodies on bodiless replies, lengths that disagree with what
came, silence past the read timeout, endless interim heads) behind a real pass-through."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx
import pytest
from dfp_capture import upstream as upstream_client

from .conftest import wait_records
from .test_passthrough import CHAT
from .test_relay import _client, _get, _read_request, _serve
from .test_resilience import raw_upstream


def _chat(text: str) -> dict:
    return {**CHAT, "messages": [{"role": "user", "content": text}]}


def _answer(request: bytes, status: bytes = b"200 OK") -> bytes:
    """A whole chat reply that echoes the request's user text (``stolen`` for a request that has none)."""
    body = request.split(b"\r\n\r\n", 1)[1]
    text = json.loads(body)["messages"][-1]["content"] if body else "stolen"
    reply = json.dumps({"model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": f"echo: {text}"}}]})
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status, len(reply), reply.encode())


STRAY = _answer(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n")  # a whole reply nobody asked for


def _post(url: str, text: str, client: httpx.Client | None = None) -> httpx.Response:
    if client is not None:
        return client.post(url + "/v1/chat/completions", json=_chat(text))
    with httpx.Client(timeout=10) as client:
        return client.post(url + "/v1/chat/completions", json=_chat(text))


def _first_cleanly(url: str, text: str, client: httpx.Client) -> httpx.Response | None:
    """The reply to a request whose upstream reply broke its framing: None where the client's connection was cut."""
    try:
        return _post(url, text, client)
    except httpx.HTTPError:
        return None


def _echoed(reply: httpx.Response) -> str | None:
    return reply.json()["choices"][0]["message"]["content"] if reply.status_code == 200 else None


def _after_first(extra: bytes, delay_s: float, head: bytes | None = None):
    """Answers every request with its own reply, but a request that says ``first``: with ``head`` (default its
    own reply), then ``extra`` ``delay_s`` later (bytes after a reply's end)."""
    async def handler(reader, writer, seen):
        while True:
            request = await _read_request(reader)
            seen.append(request)
            first = b"first" in request
            writer.write(head if first and head is not None else _answer(request))
            await writer.drain()
            if first:
                if delay_s:
                    await asyncio.sleep(delay_s)
                writer.write(extra)
                await writer.drain()
    return handler


@pytest.mark.parametrize("delay_ms", [0, 2, 10])
def test_a_stray_reply_after_a_complete_one_never_reaches_the_next_client(capture, delay_ms):
    with raw_upstream(_after_first(STRAY, delay_ms / 1000)) as (url, _):
        proxy = capture(capture_upstream=url)
        with httpx.Client(timeout=10) as one, httpx.Client(timeout=10) as two:
            for attempt in range(5):
                assert _echoed(_post(proxy.url, f"first {attempt}", one)) == f"echo: first {attempt}"
                second = _post(proxy.url, f"second {attempt}", two)  # at once: the stray may be on its way
                assert _echoed(second) == f"echo: second {attempt}"


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
@pytest.mark.parametrize("delay_ms", [0, 10])
def test_a_bodiless_reply_with_a_body_never_hands_it_to_the_next_client(capture, status, delay_ms):
    head = b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n" % (status, len(STRAY))
    with raw_upstream(_after_first(STRAY, delay_ms / 1000, head)) as (url, _):
        proxy = capture(capture_upstream=url)
        with httpx.Client(timeout=10) as two:
            for attempt in range(3):
                with httpx.Client(timeout=10) as one:
                    first = _first_cleanly(proxy.url, f"first {attempt}", one)
                    assert first is None or first.status_code == 502 or (
                        (first.status_code, first.content) == (int(status[:3]), b""))
                    assert _echoed(_post(proxy.url, f"second {attempt}", two)) == f"echo: second {attempt}"


@pytest.mark.parametrize("delay_ms", [0, 10])
def test_a_length_shorter_than_the_body_sent_never_hands_the_rest_to_the_next_client(capture, delay_ms):
    """The first reply says 2 bytes and sends a whole reply after them: its client gets its 2 bytes (or a
    clean failure), the next client its own reply."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    with raw_upstream(_after_first(STRAY, delay_ms / 1000, head)) as (url, _):
        proxy = capture(capture_upstream=url)
        with httpx.Client(timeout=10) as two:
            for attempt in range(3):
                with httpx.Client(timeout=10) as one:
                    first = _first_cleanly(proxy.url, f"first {attempt}", one)
                    assert first is None or first.status_code == 502 or (first.status_code, first.content) == (200, b"{}")
                    assert _echoed(_post(proxy.url, f"second {attempt}", two)) == f"echo: second {attempt}"


def test_a_length_longer_than_the_body_sent_fails_only_its_own_request(capture):
    async def handler(reader, writer, seen):
        request = await _read_request(reader)
        seen.append(request)
        if b"short" in request:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{}")
            await writer.drain()
            writer.close()
            return
        writer.write(_answer(request))
        await writer.drain()

    with raw_upstream(handler) as (url, _):
        proxy = capture(capture_upstream=url)
        with pytest.raises(httpx.HTTPError):
            _post(proxy.url, "short")
        assert _echoed(_post(proxy.url, "next")) == "echo: next"


def _duplicating(request_delays: list[float]):
    """Answers each request with its own reply, then sends the same reply again a moment later (as an upstream
    that answered twice would)."""
    async def handler(reader, writer, seen):
        while True:
            request = await _read_request(reader)
            seen.append(request)
            reply = _answer(request)
            writer.write(reply)
            await writer.drain()
            await asyncio.sleep(random.choice(request_delays))
            writer.write(reply)
            await writer.drain()
    return handler


def test_sixty_concurrent_clients_each_get_their_own_answer_and_record(capture, tmp_path):
    rounds, clients = 3, 60

    async def one(url: str, n: int) -> list[tuple[str, str | None]]:
        got = []
        async with httpx.AsyncClient(timeout=20) as client:
            for r in range(rounds):
                text = f"client {n} round {r}"
                reply = await client.post(url + "/v1/chat/completions", json=_chat(text))
                got.append((text, _echoed(reply)))
        return got

    async def main(url: str):
        return [pair for got in await asyncio.gather(*[one(url, n) for n in range(clients)]) for pair in got]

    with raw_upstream(_duplicating([0, 0.001, 0.003, 0.01])) as (url, _):
        proxy = capture(capture_upstream=url, capture_enabled=True)
        pairs = asyncio.run(main(proxy.url))
    wrong = [(text, answer) for text, answer in pairs if answer != f"echo: {text}"]
    assert wrong == [] and len(pairs) == rounds * clients
    found = wait_records(tmp_path / "capture", rounds * clients)
    assert len(found) == rounds * clients
    for record in found:
        prompt, answer = record["messages"][-2]["content"], record["messages"][-1]["content"]
        assert answer == f"echo: {prompt}"


def test_a_post_the_upstream_is_slow_to_answer_is_sent_once_and_answered_504(capture):
    """A POST on a connection a GET used before it, the upstream silent past the read timeout: the upstream
    sees the POST once (a generation is not run twice); the client gets 504."""
    async def handler(reader, writer, seen):
        while True:
            request = await _read_request(reader)
            seen.append(request)
            if request.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                continue
            await asyncio.sleep(30)

    with raw_upstream(handler) as (url, seen):
        proxy = capture(capture_upstream=url, capture_read_timeout_s=0.3)
        with httpx.Client(timeout=10) as client:
            assert client.get(proxy.url + "/health").status_code == 200
            status = client.post(proxy.url + "/v1/chat/completions", json=_chat("slow")).status_code
        time.sleep(0.5)  # room for a second send, were there one
        assert [r.split(b" ", 1)[0] for r in seen] == [b"GET", b"POST"]
        assert status == 504


def test_interim_heads_count_toward_the_head_timeout(capture):
    async def handler(reader, writer, seen):
        request = await _read_request(reader)
        seen.append(request)
        for _ in range(20):
            writer.write(b"HTTP/1.1 102 Processing\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(_answer(request))
        await writer.drain()
        await asyncio.sleep(5)

    with raw_upstream(handler) as (url, _):
        proxy = capture(capture_upstream=url, capture_read_timeout_s=0.5)
        started = time.monotonic()
        reply = _post(proxy.url, "held")
        assert reply.status_code == 504, reply.content  # the final head came 2 s in, past the 0.5 s bound
        assert time.monotonic() - started < 10  # hang guard


def test_the_upstream_is_asked_to_close_and_sees_each_request_on_its_own_connection(capture):
    with raw_upstream(_after_first(b"", 0)) as (url, seen):
        proxy = capture(capture_upstream=url)
        with httpx.Client(timeout=10) as client:
            for n in range(3):
                assert _echoed(_post(proxy.url, f"n{n}", client)) == f"echo: n{n}"
    assert all(re.search(rb"\r\nconnection: close\r\n", r.lower()) for r in seen)


def test_a_done_connection_is_closed_when_the_upstream_closes_it_or_soon_after(monkeypatch):
    """The upstream is asked to close (so the closed connection's wait is on its side); one that keeps the
    connection open sees it closed ``LINGER_S`` after the reply; one that sends more meanwhile, at once."""
    monkeypatch.setattr(upstream_client, "LINGER_S", 0.3)
    closed_by_proxy: dict[bytes, float] = {}

    async def handler(reader, writer):
        request = await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        target = request.split(b" ")[1]
        if target == b"/closes":
            writer.close()
            return
        if target == b"/strays":
            await asyncio.sleep(0.05)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray")
        sent = time.monotonic()
        await reader.read()  # the proxy's close
        closed_by_proxy[target] = time.monotonic() - sent

    async def main():
        server, url, _ = await _serve(handler)
        client = _client(url)
        try:
            got = [await _get(client, target) for target in (b"/closes", b"/keeps", b"/strays")]
            for _ in range(200):
                if len(closed_by_proxy) == 2 and not client.closing:
                    break
                await asyncio.sleep(0.02)
            return got, client.closing
        finally:
            client.close()
            server.close()

    got, closing = asyncio.run(main())
    assert [body for _, _, body in got] == [b"ok"] * 3 and not closing
    assert set(closed_by_proxy) == {b"/keeps", b"/strays"}
    assert closed_by_proxy[b"/strays"] < closed_by_proxy[b"/keeps"]
