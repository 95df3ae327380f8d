"""What no request, reply or upstream can do to the pass-through: stop its writer, grow its memory without
bound, hang its requests or slip bytes of one reply into another."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import contextmanager

import httpx
import pytest
from dfp_capture.assemble import EventReader, Unusable, admit, settle
from dfp_capture.upstream import UpstreamError
from dfp_shared.storage.store import LocalStore

from .conftest import counter, records, wait_records
from .test_passthrough import CHAT, OPT_IN, raw
from .test_relay import _client, _get, _read_request, _serve
from .test_storage import _capture, _writer

DEEP = b"[" * 100_000 + b"]" * 100_000
WHOLE_REPLY = json.dumps({"model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                                      "finish_reason": "stop"}]}).encode()


@contextmanager
def raw_upstream(handler):
    """A raw TCP upstream on loopback in its own thread; yields (its URL, the requests it read)."""
    loop = asyncio.new_event_loop()
    seen: list[bytes] = []

    async def on_connect(reader, writer):
        await handler(reader, writer, seen)

    server, url, _ = loop.run_until_complete(_serve(on_connect))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield url, seen
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _answer(reply_body: bytes):
    async def handler(reader, writer, seen):
        while True:
            seen.append(await _read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(reply_body), reply_body))
            await writer.drain()
    return handler


def _ready(url: str) -> int:
    return raw(url, "/readyz")[0]


# the writer


def test_a_capture_that_cannot_be_encoded_is_dropped_and_the_rest_written(tmp_path):
    writer = _writer(LocalStore(tmp_path), max_records=10)
    bad = _capture("bad")
    bad.exchange.prompt[0]["content"] = "lone \ud800"  # what a record built elsewhere might still hold
    before = counter("dfp_capture_dropped_total", reason="unencodable")
    for capture in (_capture("first"), bad, _capture("last")):
        writer.submit(capture)
    assert asyncio.run(writer.flush()) == 2
    assert [r["messages"][0]["content"] for r in records(tmp_path)] == ["first", "last"]
    assert counter("dfp_capture_dropped_total", reason="unencodable") - before == 1


def test_the_flush_loop_goes_on_after_a_flush_fails(tmp_path):
    writer = _writer(LocalStore(tmp_path), max_records=10, flush_interval_s=0.01)
    failures = []
    flush = writer.flush

    async def failing_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("a flush that broke")
        return await flush()

    writer.flush = failing_once

    async def main():
        writer.start()
        writer.submit(_capture("kept"))
        for _ in range(500):
            if records(tmp_path):
                break
            await asyncio.sleep(0.01)
        running = writer.running
        await writer.stop()
        return running

    assert asyncio.run(main()) and failures
    assert [r["messages"][0]["content"] for r in records(tmp_path)] == ["kept"]


def test_lone_surrogates_in_a_request_cost_nothing_but_themselves(upstream, capture, tmp_path):
    proxy = capture(capture_enabled=True)
    odd = {**CHAT, "chat_template_kwargs": {"mode": "\ud800"},
           "messages": [{"role": "user", "content": "odd \udfff one"}]}
    body = json.dumps(odd).encode()  # escaped as \\ud800: valid JSON, a lone surrogate once parsed
    with httpx.Client(timeout=10) as client:
        reply = client.post(proxy.url + "/v1/chat/completions", content=body,
                            headers={"content-type": "application/json"})
    assert reply.status_code == 200
    raw(proxy.url, "/v1/chat/completions", CHAT)
    found = wait_records(tmp_path / "capture", 2)
    assert sorted(r["messages"][-2]["content"] for r in found) == ["hello there", "odd \ufffd one"]
    odd_record = next(r for r in found if r["messages"][0]["content"].startswith("odd"))
    assert odd_record["meta"]["sampling"]["chat_template_kwargs"] == {"mode": "\ufffd"}
    assert _ready(proxy.url) == 200


def test_replies_and_events_nested_too_deep_are_unusable():
    exchange = admit("chat", b'{"messages": [{"role": "user", "content": "q"}], "stream": true}', 8, 4, 2**20)
    with pytest.raises(Unusable):
        settle(exchange, DEEP, None, True)
    with pytest.raises(Unusable):
        settle(exchange, b"data: " + DEEP + b"\n\n", EventReader(exchange), False)
    with pytest.raises(Unusable):
        admit("chat", b'{"messages": [{"role": "user", "content": "q"}], "x": ' + DEEP + b"}", 8, 4, 2**20)


def test_a_reply_nested_too_deep_is_dropped_and_capture_goes_on(capture, tmp_path):
    replies = [DEEP, WHOLE_REPLY]

    async def handler(reader, writer, seen):
        while replies:
            seen.append(await _read_request(reader))
            body = replies.pop(0)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()

    with raw_upstream(handler) as (url, _):
        proxy = capture(capture_upstream=url, capture_enabled=True, capture_flush_interval_s=0.05)
        first = raw(proxy.url, "/v1/chat/completions", CHAT)
        second = raw(proxy.url, "/v1/chat/completions", CHAT)
        assert first[0] == second[0] == 200 and first[2] == DEEP
        assert len(wait_records(tmp_path / "capture", 1)) == 1
        assert proxy.app.state.writer.running


def test_a_request_nested_too_deep_is_forwarded_unrecorded(capture, tmp_path):
    with raw_upstream(_answer(WHOLE_REPLY)) as (url, seen):
        proxy = capture(capture_upstream=url, capture_enabled=True)
        body = b'{"messages": [{"role": "user", "content": "q"}], "x": ' + DEEP + b"}"
        with httpx.Client(timeout=10) as client:
            reply = client.post(proxy.url + "/v1/chat/completions", content=body)
        assert reply.status_code == 200 and reply.content == WHOLE_REPLY
        assert seen and seen[-1].endswith(body)
    assert records(tmp_path / "capture") == []


# the upstream's reply head


def _head_reply(head: bytes, body: bytes = b"ok"):
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(head + body)
        await writer.drain()
        await asyncio.sleep(30)
    return handler


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(200)) + b"\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-big: " + b"v" * 70_000 + b"\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-unfinished: " + b"v" * 200_000,
])
def test_a_reply_head_past_its_bounds_is_an_upstream_error(head):
    async def main():
        server, url, _ = await _serve(_head_reply(head))
        try:
            with pytest.raises(UpstreamError):
                await asyncio.wait_for(_get(_client(url, read_timeout=30.0)), 10)
        finally:
            server.close()

    asyncio.run(main())


def test_a_reply_head_dripped_slowly_runs_out_of_time():
    async def drip(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n")
        for i in range(40):
            writer.write(b"x-h%d: v\r\n" % i)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"\r\nok")
        await writer.drain()
        await asyncio.sleep(5)

    async def main():
        server, url, _ = await _serve(drip)
        try:
            with pytest.raises(UpstreamError):
                await asyncio.wait_for(_get(_client(url, read_timeout=0.3)), 10)
        finally:
            server.close()

    asyncio.run(main())


def test_trailers_past_a_small_bound_break_the_reply():
    trailers = b"".join(b"x-t%d: %s\r\n" % (i, b"v" * 100) for i in range(1000))
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"

    async def main():
        server, url, _ = await _serve(_head_reply(head, b"2\r\nok\r\n0\r\n" + trailers + b"\r\n"))
        try:
            with pytest.raises(UpstreamError):
                await asyncio.wait_for(_get(_client(url)), 10)
        finally:
            server.close()

    asyncio.run(main())


def test_a_huge_head_through_the_pass_through_is_a_502(capture):
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(200)) + b"\r\n"

    async def handler(reader, writer, seen):
        await _read_request(reader)
        writer.write(head + b"ok")
        await writer.drain()
        await asyncio.sleep(5)

    with raw_upstream(handler) as (url, _):
        proxy = capture(capture_upstream=url)
        assert raw(proxy.url, "/v1/models")[0] == 502


# interim replies


def test_interim_replies_are_skipped_for_the_final_one():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
                     b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-final: 1\r\n\r\nfinal")
        await writer.drain()
        await asyncio.sleep(5)

    async def main():
        server, url, _ = await _serve(handler)
        try:
            return await asyncio.wait_for(_get(_client(url)), 10)
        finally:
            server.close()

    status, headers, body = asyncio.run(main())
    assert (status, body) == (200, b"final")
    assert headers == [(b"content-length", b"5"), (b"x-final", b"1")]


def test_expect_is_not_forwarded(capture):
    with raw_upstream(_answer(WHOLE_REPLY)) as (url, seen):
        proxy = capture(capture_upstream=url)
        assert raw(proxy.url, "/v1/chat/completions", CHAT, {"Expect": "100-continue"})[0] == 200
        assert b"expect:" not in seen[-1].lower()


# bytes past a reply's end


def test_bytes_after_a_reply_end_close_its_connection():
    async def handler(reader, writer):
        while True:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                         b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nextra")
            await writer.drain()

    async def main():
        server, url, accepted = await _serve(handler)
        client = _client(url)
        try:
            got = [await asyncio.wait_for(_get(client), 10) for _ in range(2)]
        finally:
            client.close()
            server.close()
        return got, len(accepted)

    got, connections = asyncio.run(main())
    assert [body for _, _, body in got] == [b"ok", b"ok"] and connections == 2


# a full pool


def test_a_full_pool_answers_503_and_readiness_still_probes(capture):
    async def handler(reader, writer, seen):
        while True:
            request = await _read_request(reader)
            seen.append(request)
            if request.startswith(b"GET /health"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"6\r\ndata: \r\n")
            await writer.drain()
            await asyncio.sleep(30)  # a reply that holds its connection

    with raw_upstream(handler) as (url, _):
        proxy = capture(capture_upstream=url, capture_max_connections=1, capture_connect_timeout_s=0.3)
        before = counter("dfp_capture_requests_total", route="chat", outcome="upstream_busy")
        with httpx.Client(timeout=10) as held_client:
            with held_client.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, headers=OPT_IN) as held:
                assert held.status_code == 200
                with httpx.Client(timeout=10) as client:
                    busy = client.post(proxy.url + "/v1/chat/completions", json=CHAT)
                    assert busy.status_code == 503 and busy.headers.get("retry-after")
                    assert client.get(proxy.url + "/readyz").status_code == 200
        assert counter("dfp_capture_requests_total", route="chat", outcome="upstream_busy") - before == 1
