"""The HTTP client of the REST API (httpx): calls, the server's error messages, and a job's event stream."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import click
import httpx
from httpx_sse import EventSource, SSEError

from dfp_shared.printable import printable

DEFAULT_URL = "http://127.0.0.1:8000"


class Api:
    """Thin httpx wrapper: raises ClickException with the server's message on errors."""

    def __init__(self, url: str, key: str | None, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    def call(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise click.ClickException(f"cannot reach the API at {self.http.base_url}: {exc}") from None
        if resp.status_code >= 400:
            raise click.ClickException(describe_error(resp))
        return resp


def describe_error(resp: httpx.Response) -> str:
    """The server's error as lines to print, without control characters (it may quote a user's text)."""
    return printable(_error_lines(resp))


def _error_lines(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:300]}"
    fields = body.get("fields") or []
    message = "" if fields else body.get("message", "")
    lines = [f"HTTP {resp.status_code} {body.get('error', '')}: {message}".rstrip(" :")]
    for f in fields:
        lines.append(f"  {f['field']}: {f['reason']}")
    if resp.status_code == 429 and resp.headers.get("Retry-After"):
        lines.append(f"  retry after {resp.headers['Retry-After']} s")
    return "\n".join(lines)


def sse_events(api: Api, job_id: str, last_id: str | None = None) -> Iterator[tuple[str, str | None, dict]]:
    """(event, id, data) from the job's event stream, reconnecting (with Last-Event-ID) until ``end``. The id
    is the stream's last event id (an event without one of its own carries the one before it, as SSE has it)."""
    failures = 0
    while True:
        headers = {"Accept": "text/event-stream", **({"Last-Event-ID": last_id} if last_id else {})}
        try:
            with api.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers,
                                 timeout=httpx.Timeout(30.0, read=None)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise click.ClickException(describe_error(resp))
                for sse in EventSource(resp).iter_sse():
                    if not sse.data:
                        continue
                    payload = json.loads(sse.data)
                    if sse.id:
                        last_id = sse.id
                    yield sse.event, sse.id or None, payload
                    if sse.event == "end":
                        return
            failures = 0
        except SSEError as exc:
            raise click.ClickException(f"the API at {api.http.base_url} did not answer with an event stream: "
                                       f"{exc}") from None
        except httpx.TransportError as exc:
            failures += 1
            if failures > 5:
                raise click.ClickException(f"lost the event stream of {job_id}: {exc}") from None
            time.sleep(min(5.0, 0.5 * failures))
