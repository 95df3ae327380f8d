"""The CLI's reader of a job's event stream: events as the server frames them, resumed after a broken
connection with the last event id seen, backing off while the API cannot be reached."""

from __future__ import annotations

import json

import click
import httpx
import pytest
from dfp_shared import api_client
from dfp_shared.api_client import Api, sse_events

SSE = {"content-type": "text/event-stream; charset=utf-8"}


class _Broken(httpx.SyncByteStream):
    """A response body that sends ``chunks`` and then loses its connection."""

    def __init__(self, chunks: list[bytes]):
        self.chunks = chunks

    def __iter__(self):
        yield from self.chunks
        raise httpx.ReadError("connection reset")


def _api(handler) -> Api:
    api = Api("http://api.test", "k")
    api.http = httpx.Client(base_url="http://api.test", transport=httpx.MockTransport(handler))
    return api


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(api_client.time, "sleep", slept.append)
    return slept


def test_events_are_read_across_a_broken_connection_resuming_after_the_last_id(sleeps):
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) == 1:
            return httpx.Response(200, headers=SSE, stream=_Broken([
                b'id: 1-0\nevent: state\ndata: {"state": "running"}\n\n',
                b": keep-alive\n\n",
                b'event: progress\r\ndata: {"progress": 0.5}\r\n\r\n',
                b'id: 2-0\nevent: state\ndata: {"state": "succ',  # cut off before the event ends
            ]))
        body = (b'id: 2-0\nevent: state\ndata: {"state":\ndata: "succeeded"}\n\n'
                b'event: end\ndata: {"state": "succeeded"}\n\n'
                b'id: 3-0\nevent: state\ndata: {"state": "never read"}\n\n')
        return httpx.Response(200, headers=SSE, content=body)

    events = list(sse_events(_api(handler), "job-1"))
    assert [(event, data) for event, _, data in events] == [
        ("state", {"state": "running"}), ("progress", {"progress": 0.5}), ("state", {"state": "succeeded"}),
        ("end", {"state": "succeeded"})]
    assert events[0][1] == "1-0" and events[2][1] == "2-0"
    assert [r.url.path for r in seen] == ["/v1/jobs/job-1/events"] * 2
    assert "last-event-id" not in seen[0].headers and seen[1].headers["last-event-id"] == "1-0"
    assert all(r.headers["accept"] == "text/event-stream" for r in seen)
    assert sleeps == [0.5]


def test_a_stream_that_ends_without_end_is_reopened_at_once_from_the_given_id(sleeps):
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) == 1:
            return httpx.Response(200, headers=SSE, content=b'id: 8-1\nevent: metrics\ndata: {"step": 3}\n\n')
        return httpx.Response(200, headers=SSE, content=b'event: end\ndata: {"state": "failed"}\n\n')

    events = list(sse_events(_api(handler), "job-2", last_id="7-0"))
    assert [(event, data) for event, _, data in events] == [("metrics", {"step": 3}), ("end", {"state": "failed"})]
    assert [r.headers["last-event-id"] for r in seen] == ["7-0", "8-1"]
    assert sleeps == []


def test_an_unreachable_api_is_retried_five_times_with_growing_pauses(sleeps):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("connection refused")

    with pytest.raises(click.ClickException, match="lost the event stream of job-3: connection refused"):
        list(sse_events(_api(handler), "job-3"))
    assert len(calls) == 6
    assert sleeps == [0.5, 1.0, 1.5, 2.0, 2.5]


def test_an_error_answer_is_the_server_s_message():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": "not_found", "message": "no job job-4"})

    with pytest.raises(click.ClickException) as err:
        list(sse_events(_api(handler), "job-4"))
    assert err.value.message == "HTTP 404 not_found: no job job-4"


def test_event_data_is_json():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=SSE, content=b"event: state\ndata: not json\n\n")

    with pytest.raises(json.JSONDecodeError):
        list(sse_events(_api(handler), "job-5"))


def test_an_answer_that_is_no_event_stream_is_refused():
    """A 200 page from something in front of the API (a proxy's login page) is not read as events."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/html"}, content=b"<html>sign in</html>\n\n")

    with pytest.raises(click.ClickException, match="did not answer with an event stream"):
        list(sse_events(_api(handler), "job-6"))


def test_a_line_separator_inside_the_data_is_part_of_it():
    """Only CR and LF end a line of an event stream, not the other line breaks Python's splitlines knows."""
    def handler(request: httpx.Request) -> httpx.Response:
        data = json.dumps({"error": "a\u2028b\x1cc"}, ensure_ascii=False).encode()
        return httpx.Response(200, headers=SSE, content=b"event: end\ndata: " + data + b"\n\n")

    assert list(sse_events(_api(handler), "job-7")) == [("end", None, {"error": "a\u2028b\x1cc"})]
