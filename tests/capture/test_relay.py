"""The relay's own HTTP/1.1 client against raw upstreams (framings, keep-alive, broken and silent
connections), and replies read into exchanges whatever their chunking."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from dfp_capture import proxy
from dfp_capture.assemble import EventReader, Unusable, admit, settle
from dfp_capture.upstream import UpstreamClient, UpstreamError

from .conftest import counter, wait_records
from .test_passthrough import CHAT, OPT_IN, raw


async def _serve(handler):
    """A raw TCP upstream on loopback; ``handler(reader, writer)`` answers each connection."""
    accepted = []

    async def on_connect(reader, writer):
        accepted.append(writer)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted


async def _read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    return head + await reader.readexactly(length)


def _client(url: str, read_timeout: float = 5.0) -> UpstreamClient:
    return UpstreamClient(url, max_connections=4, connect_timeout=2.0, read_timeout=read_timeout)


async def _get(client: UpstreamClient, target: bytes = b"/x") -> tuple[int, list, bytes]:
    reply = await client.request("GET", target, [(b"accept", b"*/*")])
    try:
        return reply.status, reply.headers, await reply.read()
    finally:
        client.release(reply)


def test_replies_of_every_framing_are_read_each_on_a_connection_of_its_own():
    replies = [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
               b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
               b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end"]
    seen = []

    async def handler(reader, writer):
        while replies:
            seen.append(await _read_request(reader))
            reply = replies.pop(0)
            writer.write(reply)
            if b"content-length" not in reply and b"chunked" not in reply:
                writer.close()
                return

    async def main():
        server, url, accepted = await _serve(handler)
        client = _client(url + "/base")
        got = [await _get(client, b"/v1/a?b=1") for _ in range(3)]
        client.close()
        server.close()
        return got, len(accepted)

    got, connections = asyncio.run(main())
    assert [(s, body) for s, _, body in got] == [(200, b"hello"), (201, b"abcde"), (200, b"until the end")]
    assert (b"x-a", b"1") in got[1][1]
    assert connections == 3
    assert seen[0].startswith(b"GET /base/v1/a?b=1 HTTP/1.1\r\nhost: 127.0.0.1:")
    assert all(b"\r\nconnection: close\r\n" in request for request in seen)


def test_replies_without_a_body_end_at_their_head():
    """A HEAD reply announces a length it does not send, and 204 / 304 replies have none: each ends at its head
    (no wait for the read timeout)."""
    replies = [b"HTTP/1.1 204 No Content\r\nserver: x\r\n\r\n", b"HTTP/1.1 304 Not Modified\r\n\r\n",
               b"HTTP/1.1 200 OK\r\ncontent-length: 42\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]

    async def handler(reader, writer):
        while replies:
            await _read_request(reader)
            writer.write(replies.pop(0))
            await writer.drain()

    async def main():
        server, url, accepted = await _serve(handler)
        client = _client(url, read_timeout=30.0)
        got = [await asyncio.wait_for(_get(client), 5) for _ in range(2)]
        head = await client.request("HEAD", b"/x", [])
        got.append((head.status, head.headers, await asyncio.wait_for(head.read(), 5)))
        client.release(head)
        got.append(await asyncio.wait_for(_get(client), 5))
        client.close()
        server.close()
        return got, len(accepted)

    got, connections = asyncio.run(main())
    assert [(s, body) for s, _, body in got] == [(204, b""), (304, b""), (200, b""), (200, b"ok")]
    assert connections == 4


def test_a_connection_the_upstream_drops_after_a_reply_costs_nothing():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # as asked: the upstream closes after its reply

    async def main():
        server, url, accepted = await _serve(handler)
        client = _client(url)
        got = [await _get(client) for _ in range(3)]
        server.close()
        return got, len(accepted)

    got, connections = asyncio.run(main())
    assert [(s, body) for s, _, body in got] == [(200, b"ok")] * 3 and connections == 3


def test_an_unreachable_broken_or_silent_upstream_is_an_upstream_error():
    async def broken(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        writer.close()

    async def silent(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await asyncio.sleep(5)

    async def main():
        with pytest.raises(UpstreamError):
            await _get(_client("http://127.0.0.1:9"))
        for handler, timeout in ((broken, 5.0), (silent, 0.2), (None, 0.2)):
            server, url, _ = await _serve(handler or (lambda r, w: asyncio.sleep(5)))
            with pytest.raises(UpstreamError):
                await _get(_client(url, read_timeout=timeout))
            server.close()

    asyncio.run(main())


def _stream_bytes(words: list[str]) -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}], "model": "m"} for w in words]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + b": done\n\ndata: [DONE]\n\n"


@pytest.mark.parametrize("size", [1, 2, 7, 64, 10_000])
def test_a_stream_is_read_whole_however_its_bytes_were_cut(size):
    data = _stream_bytes(["a", "b\nc", "d"])
    exchange = admit("chat", json.dumps({"messages": [{"role": "user", "content": "q"}], "stream": True}).encode(),
                     8, 4, 2**20)
    events = EventReader(exchange)
    for at in range(0, len(data), size):
        events.feed(data[at:at + size])
    events.finish()
    assert exchange.choices[0]["content"] == ["a", "b\nc", "d"] and exchange.choices[0]["finish"] == "stop"


def test_kept_replies_that_cannot_be_read_are_unusable():
    exchange = admit("chat", b'{"messages": [{"role": "user", "content": "q"}], "stream": true}', 8, 4, 2**20)
    for reply, whole in ((b'data: {"choices": []}\n\n', True), (b"data: {nope\n\n", False),
                         (b"data: [DONE]\n\ndata: {}\n\n", False)):
        with pytest.raises(Unusable) as raised:
            settle(exchange, reply, EventReader(exchange), whole)
        assert raised.value.reason == "malformed_reply"
    with pytest.raises(Unusable):
        settle(exchange, b"<html>", None, True)


def test_a_stream_longer_than_what_is_kept_is_read_on_the_way_and_recorded_whole(upstream, capture, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setattr(proxy, "COMPACT_BYTES", 300)
    proxy_server = capture()
    body = {**CHAT, "stream": True}
    assert raw(proxy_server.url, "/v1/chat/completions", body, OPT_IN) == raw(upstream.url, "/v1/chat/completions", body)
    [record] = wait_records(tmp_path / "capture", 1)
    assert record["messages"][-1] == {"role": "assistant", "content": "echo: hello there ",
                                      "reasoning_content": "thinking about hello there "}


def test_a_stream_past_the_record_bound_passes_through_and_is_not_recorded(upstream, capture, tmp_path):
    proxy_server = capture(capture_max_record_bytes=1024)
    before = counter("dfp_capture_dropped_total", reason="too_large")
    body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "x" * 900}]}
    assert raw(proxy_server.url, "/v1/chat/completions", body, OPT_IN) == raw(upstream.url, "/v1/chat/completions", body)
    raw(proxy_server.url, "/v1/chat/completions", CHAT, OPT_IN)
    assert len(wait_records(tmp_path / "capture", 1)) == 1
    assert counter("dfp_capture_dropped_total", reason="too_large") - before == 1


def test_an_upstream_that_goes_silent_mid_stream_cuts_the_client_and_is_not_recorded(capture, tmp_path):
    async def silent(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"1e\r\ndata: {\"choices\": []}\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(3)

    loop = asyncio.new_event_loop()
    server, url, _ = loop.run_until_complete(_serve(silent))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        proxy_server = capture(capture_upstream=url, capture_read_timeout_s=0.3, capture_enabled=True)
        with pytest.raises(httpx.HTTPError):
            raw(proxy_server.url, "/v1/chat/completions", {**CHAT, "stream": True})
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert wait_records(tmp_path / "capture", 1, timeout=0.5) == []
