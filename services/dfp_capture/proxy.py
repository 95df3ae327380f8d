"""The pass-through: Starlette routes that forward to the upstream and hand admitted exchanges to the writer.

Every reply goes to the client as the upstream sent it (status, headers but the hop-by-hop ones, and the
body's bytes as they arrive, server-sent events included), whatever capture makes of it. A capture is
decided before the request is forwarded: the operator's switch or the request's opt-in header, never
against an opt-out (``0``), then the sampling rate. Nothing the capture does can fail or slow a request:
reading the reply is bounded and a reply that cannot be read is only not recorded.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from contextlib import asynccontextmanager

from dfp_shared.metrics import metrics_payload
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import metrics
from .assemble import CHAT, COMPLETIONS, EventReader, Exchange, Unusable, admit
from .settings import CaptureSettings
from .upstream import Reply, UpstreamBusy, UpstreamClient, UpstreamError, UpstreamTimeout
from .writer import Capture, CaptureWriter

log = logging.getLogger(__name__)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "expect"}
HOP_BY_HOP_RAW = {name.encode("latin-1") for name in HOP_BY_HOP}
COMPACT_BYTES = 2**20  # a stream's kept bytes past which they are read into its exchange on the way
YES = {"1", "true", "yes", "on"}  # opt-in words; any other value of the header opts out


def header_words(headers, name: str) -> list[str]:
    """Every value of a header, however sent: repeated, listed with commas, or both."""
    values = headers.getlist(name) if hasattr(headers, "getlist") else \
        [v for k, v in headers.items() if k.lower() == name.lower()]
    return [word.strip().lower() for value in values for word in value.split(",")]


def wants_capture(settings: CaptureSettings, headers) -> bool:
    """The request's own header first (any value among its values that is not an opt-in word opts out,
    wherever it is: ``0``, ``off``, ``"0"``, ``never`` alike; else a ``1`` opts in), else the operator's switch;
    then the sampling rate."""
    said = [word for word in header_words(headers, settings.capture_header) if word]
    if any(word not in YES for word in said):
        return False
    if not any(word in YES for word in said) and not settings.capture_enabled:
        return False
    return settings.capture_sample_rate >= 1.0 or random.random() < settings.capture_sample_rate


def forward_headers(settings: CaptureSettings, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers (raw pairs) to send on, less the hop-by-hop ones and the capture header."""
    skip = HOP_BY_HOP_RAW | {settings.capture_header.lower().encode("latin-1")}
    out = [(k, v) for k, v in headers if k.lower() not in skip]
    out.append((b"accept-encoding", b"identity"))  # the bytes kept for capture are the bytes the client gets
    return out


def reply_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    skip = HOP_BY_HOP_RAW - {b"content-length"}
    return [(k, v) for k, v in headers if k.lower() not in skip]


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None past ``limit`` bytes (read no further)."""
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


class Recorder:
    """Keeps a reply's bytes for the writer, which reads them into the exchange off the request path. Bounded:
    a whole body past the record's bound is not recorded; a stream's kept bytes past ``COMPACT_BYTES`` are read
    into its exchange on the way (so a long stream keeps only its content)."""

    def __init__(self, exchange: Exchange | None, event_stream: bool):
        self.exchange = exchange
        self.events = EventReader(exchange) if exchange and event_stream else None
        self.parts: list[bytes] = []
        self.limit = 0
        if exchange is not None:
            self.limit = min(COMPACT_BYTES, exchange.max_bytes) if self.events else exchange.max_bytes

    def overflow(self, size: int) -> int:
        """The kept bytes passed the limit: returns how many are still kept."""
        try:
            if self.events is None:
                raise Unusable("too_large", "a reply larger than a record")
            self.events.feed(b"".join(self.parts))
            self.parts.clear()
            return 0
        except Unusable as exc:
            self.stop(exc.reason)
            return size

    def stop(self, reason: str) -> None:
        metrics.dropped(reason)
        self.exchange = None
        self.parts.clear()

    def capture(self, sent: bool) -> Capture | None:
        """What goes to the writer once the reply ended (``sent``) or the client left, if anything: a client
        that left a stream leaves what arrived, marked incomplete; a whole body it left is not recorded."""
        if self.exchange is None or not (sent or self.events):
            return None
        return Capture(self.exchange, time.time(), incomplete=not sent, reply=b"".join(self.parts), events=self.events)


class ClientGone(Exception):
    """The client disconnected before the reply's end."""


async def pump(reply: Reply, recorder: Recorder, send) -> int:
    """Send the reply's body to the client as it arrives (keeping it for the recorder); returns its size."""
    total = kept = 0
    keep = recorder.parts.append if recorder.exchange is not None else None
    limit = recorder.limit
    async for chunk in reply.body():
        size = len(chunk)
        total += size
        if keep is not None:
            keep(chunk)
            kept += size
            if kept > limit:
                kept = recorder.overflow(kept)
                if recorder.exchange is None:
                    keep = None
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    return total


class Relayed(Response):
    """The upstream's reply, relayed; once it ends (or the client leaves) the exchange goes to the writer."""

    def __init__(self, client: UpstreamClient, reply: Reply, recorder: Recorder, writer: CaptureWriter, route: str,
                 send_timeout: float = 60.0):
        self.client, self.reply, self.recorder, self.writer, self.route = client, reply, recorder, writer, route
        self.background = None
        self.send_timeout = send_timeout
        self.sending_since: float | None = None  # when the send now waiting for the client began
        self.stalled = False

    def _paced(self, send, loop):
        """``send`` that notes when each piece began waiting for the client (two clock reads a piece: no timer)."""
        async def paced(message) -> None:
            self.sending_since = loop.time()
            await send(message)
            self.sending_since = None
        return paced

    def _check_stall(self, loop, task) -> None:
        """Every ``send_timeout``: a piece still unread by the client after that long cuts the client off."""
        since = self.sending_since
        if since is not None and loop.time() - since >= self.send_timeout:
            self.stalled = True
            self.reply.abort(ClientGone())
            task.cancel()
            return
        wait = self.send_timeout if since is None else self.send_timeout - (loop.time() - since)
        self.stall_timer = loop.call_later(max(wait, 0.01), self._check_stall, loop, task)

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.reply.abort(ClientGone())

    async def __call__(self, scope, receive, send) -> None:
        reply, outcome, size = self.reply, "upstream_broke", 0
        watcher = asyncio.ensure_future(self._watch(receive))
        loop = asyncio.get_running_loop()
        send = self._paced(send, loop)
        self.stall_timer = loop.call_later(self.send_timeout, self._check_stall, loop, asyncio.current_task())
        try:
            await send({"type": "http.response.start", "status": reply.status, "headers": reply_headers(reply.headers)})
            size = await pump(reply, self.recorder, send)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            outcome = "sent"
        except ClientGone:
            outcome = "client_gone"
        except asyncio.CancelledError:
            if not self.stalled:
                raise
            asyncio.current_task().uncancel()  # the client stopped reading: its connection is cut, as it left
            outcome = "client_stalled"
        except UpstreamError as exc:  # the upstream broke off: the client's connection is cut, as it was
            if isinstance(reply.error, ClientGone):
                outcome = "client_gone"
            else:
                self.recorder.stop("malformed_reply")
                raise UpstreamBroke(str(exc)) from exc
        finally:
            watcher.cancel()
            self.stall_timer.cancel()
            self.client.release(reply)
            metrics.REQUESTS.labels(route=self.route, outcome=outcome).inc()
            metrics.BYTES.labels(direction="proxied").inc(size)
            if outcome not in ("upstream_broke", "client_stalled"):
                capture = self.recorder.capture(outcome == "sent")
                if capture is not None:
                    self.writer.submit(capture)


class UpstreamBroke(Exception):
    """The upstream's reply ended in a transport error after it had begun."""


async def forward(request: Request, route: str, kind: str | None = None) -> Response:
    state = request.app.state
    settings: CaptureSettings = state.settings
    body = await read_body(request, settings.capture_max_body_bytes)
    if body is None:
        metrics.REQUESTS.labels(route=route, outcome="too_large").inc()
        return JSONResponse({"error": {"message": "request body too large", "type": "invalid_request_error"}}, 413)
    exchange = None
    if kind and wants_capture(settings, request.headers):
        try:
            exchange = admit(kind, body, settings.capture_max_messages, settings.capture_max_choices,
                             settings.capture_max_record_bytes)
        except Unusable as exc:
            metrics.dropped(exc.reason)
        except Exception:  # noqa: BLE001 - a request capture cannot read is forwarded all the same, unrecorded
            metrics.dropped("unreadable_request")
            log.warning("request not captured", exc_info=True)
    scope = request.scope
    target = scope.get("raw_path") or scope["path"].encode("latin-1")
    if scope["query_string"]:
        target += b"?" + scope["query_string"]
    client: UpstreamClient = state.client
    try:
        reply = await client.request(request.method, target, forward_headers(settings, scope["headers"]),
                                     body if request.method == "POST" else None)
    except UpstreamBusy:
        metrics.REQUESTS.labels(route=route, outcome="upstream_busy").inc()
        return JSONResponse({"error": {"message": "every upstream connection is busy", "type": "upstream_busy"}},
                            503, headers={"retry-after": "1"})
    except UpstreamTimeout as exc:  # sent once: a request the upstream may still be working on is not sent again
        metrics.REQUESTS.labels(route=route, outcome="upstream_timeout").inc()
        log.warning("upstream timed out", extra={"error": str(exc)})
        return JSONResponse({"error": {"message": "upstream timed out", "type": "upstream_timeout"}}, 504)
    except UpstreamError as exc:
        metrics.REQUESTS.labels(route=route, outcome="upstream_error").inc()
        log.warning("upstream unreachable", extra={"error": str(exc)})
        return JSONResponse({"error": {"message": "upstream unreachable", "type": "upstream_error"}}, 502)
    if exchange is not None and reply.status != 200:
        metrics.dropped("upstream_status")
        exchange = None
    event_stream = False
    if exchange is not None:
        content_type = next((v for k, v in reply.headers if k.lower() == b"content-type"), b"")
        event_stream = content_type.lower().startswith(b"text/event-stream")
    return Relayed(client, reply, Recorder(exchange, event_stream), state.writer, route, settings.capture_send_timeout_s)


async def chat(request: Request) -> Response:
    return await forward(request, "chat", CHAT)


async def completions(request: Request) -> Response:
    return await forward(request, "completions", COMPLETIONS)


async def passthrough(request: Request) -> Response:
    return await forward(request, request.url.path.strip("/").replace("/", "_"))


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Ready while the writer runs and the upstream answers its ``/health``."""
    state = request.app.state
    if not state.writer.running:
        return JSONResponse({"status": "writer stopped"}, 503)
    try:
        status, _ = await state.client.fetch("GET", b"/health", [], timeout=2.0, probe=True)
    except UpstreamError:
        return JSONResponse({"status": "upstream unreachable"}, 503)
    if status >= 500:
        return JSONResponse({"status": f"upstream answers {status}"}, 503)
    return JSONResponse({"status": "ok"})


async def metrics_route(request: Request) -> Response:
    body, content_type = metrics_payload()
    return Response(body, media_type=content_type)


def create_app(settings: CaptureSettings, writer: CaptureWriter) -> Starlette:
    """The pass-through app; it starts and stops ``writer`` with itself."""

    @asynccontextmanager
    async def lifespan(app):
        client = UpstreamClient(settings.capture_upstream, max_connections=settings.capture_max_connections,
                                connect_timeout=settings.capture_connect_timeout_s,
                                read_timeout=settings.capture_read_timeout_s)
        app.state.client = client
        writer.start()
        try:
            yield
        finally:
            await asyncio.shield(writer.stop())
            client.close()

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", passthrough, methods=["GET"]),
              Route("/health", passthrough, methods=["GET"]),
              Route("/healthz", healthz, methods=["GET"]),
              Route("/readyz", readyz, methods=["GET"]),
              Route("/metrics", metrics_route, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.settings, app.state.writer = settings, writer
    return app
