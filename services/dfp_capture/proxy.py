"""The pass-through: Starlette routes that forward to the upstream and hand admitted exchanges to the writer.

Every reply goes to the client as the upstream sent it (status, headers but the hop-by-hop ones, and the
body's bytes as they arrive, server-sent events included), whatever capture makes of it. A capture is
decided before the request is forwarded: the operator's switch or the request's opt-in header, never
against an opt-out (``0``), then the sampling rate. Nothing the capture does can fail or slow a request:
reading the reply is bounded and a reply that cannot be read is only not recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from contextlib import asynccontextmanager

import anyio
import httpx
from dfp_shared.metrics import metrics_payload
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import metrics
from .assemble import CHAT, COMPLETIONS, EventReader, Exchange, Unusable, admit, read_reply
from .settings import CaptureSettings
from .writer import Capture, CaptureWriter

log = logging.getLogger(__name__)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"}
YES, NO = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def wants_capture(settings: CaptureSettings, headers) -> bool:
    """The request's own header first (``0`` always opts out, ``1`` opts in), else the operator's switch;
    then the sampling rate."""
    said = (headers.get(settings.capture_header) or "").strip().lower()
    if said in NO:
        return False
    if said not in YES and not settings.capture_enabled:
        return False
    return settings.capture_sample_rate >= 1.0 or random.random() < settings.capture_sample_rate


def forward_headers(settings: CaptureSettings, headers) -> dict:
    skip = HOP_BY_HOP | {settings.capture_header.lower()}
    out = {k: v for k, v in headers.items() if k.lower() not in skip}
    out["accept-encoding"] = "identity"  # the bytes read for capture are the bytes the client gets
    return out


def reply_headers(headers: httpx.Headers) -> list[tuple[bytes, bytes]]:
    skip = HOP_BY_HOP - {"content-length"}
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.multi_items() if k.lower() not in skip]


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
    """Reads a reply's bytes into an exchange; at the first thing it cannot read it stops (counted)."""

    def __init__(self, exchange: Exchange | None, event_stream: bool):
        self.exchange = exchange
        self.events = EventReader(exchange) if exchange and event_stream else None
        self.body: list[bytes] = []
        self.size = 0

    def feed(self, chunk: bytes) -> None:
        if self.exchange is None:
            return
        try:
            if self.events:
                self.events.feed(chunk)
            else:
                self.size += len(chunk)
                if self.size > self.exchange.max_bytes:
                    raise Unusable("too_large", "a reply larger than a record")
                self.body.append(chunk)
        except Unusable as exc:
            self.stop(exc.reason)

    def stop(self, reason: str) -> None:
        metrics.dropped(reason)
        self.exchange = None

    def finish(self) -> Exchange | None:
        """The exchange of a reply read to its end, or None when it is not to be recorded."""
        if self.exchange is None:
            return None
        try:
            if self.events:
                self.events.finish()
            else:
                read_reply(self.exchange, json.loads(b"".join(self.body)))
        except (Unusable, ValueError) as exc:
            self.stop(getattr(exc, "reason", "malformed_reply"))
        return self.exchange


class UpstreamBroke(Exception):
    """The upstream's reply ended in a transport error after it had begun."""


async def relay(upstream: httpx.Response, recorder: Recorder, receive, send) -> bool:
    """Send the upstream's reply to the client as it arrives, watching for the client leaving; returns whether
    the whole reply was sent."""
    state = {"sent": False}
    async with anyio.create_task_group() as group:
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        async def pump():
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": reply_headers(upstream.headers)})
            try:
                async for chunk in upstream.aiter_raw():
                    metrics.BYTES.labels(direction="proxied").inc(len(chunk))
                    recorder.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:  # the upstream broke off: the client's connection is cut, as it was
                recorder.stop("malformed_reply")
                raise UpstreamBroke(f"{type(exc).__name__}: {exc}") from exc
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            state["sent"] = True
            group.cancel_scope.cancel()

        group.start_soon(watch)
        group.start_soon(pump)
    return state["sent"]


class Relayed(Response):
    """The upstream's reply, relayed; once it ends (or the client leaves) the exchange goes to the writer."""

    def __init__(self, upstream: httpx.Response, recorder: Recorder, writer: CaptureWriter, route: str):
        self.upstream, self.recorder, self.writer, self.route = upstream, recorder, writer, route
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        outcome = "upstream_broke"
        try:
            outcome = "sent" if await relay(self.upstream, self.recorder, receive, send) else "client_gone"
        finally:
            with anyio.CancelScope(shield=True):
                await self.upstream.aclose()
            metrics.REQUESTS.labels(route=self.route, outcome=outcome).inc()
            if outcome != "upstream_broke":
                self._hand_over(outcome == "sent")

    def _hand_over(self, sent: bool) -> None:
        recorder = self.recorder
        if recorder.exchange is None:
            return
        if sent:
            exchange = recorder.finish()
        else:  # the client left: a stream keeps what arrived, marked incomplete; a whole body is not recorded
            exchange = recorder.exchange if recorder.events else None
        if exchange is not None and exchange.choices:
            self.writer.submit(Capture(exchange, time.time(), incomplete=not sent))


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
    url = settings.capture_upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    upstream_request = state.client.build_request(request.method, url, headers=forward_headers(settings, request.headers),
                                                  content=body if request.method == "POST" else None)
    try:
        upstream = await state.client.send(upstream_request, stream=True)
    except httpx.HTTPError as exc:
        metrics.REQUESTS.labels(route=route, outcome="upstream_error").inc()
        log.warning("upstream unreachable", extra={"error": f"{type(exc).__name__}: {exc}"})
        return JSONResponse({"error": {"message": "upstream unreachable", "type": "upstream_error"}}, 502)
    if exchange is not None and upstream.status_code != 200:
        metrics.dropped("upstream_status")
        exchange = None
    event_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
    return Relayed(upstream, Recorder(exchange, event_stream), state.writer, route)


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
        reply = await state.client.get(state.settings.capture_upstream + "/health", timeout=2.0)
    except httpx.HTTPError:
        return JSONResponse({"status": "upstream unreachable"}, 503)
    if reply.status_code >= 500:
        return JSONResponse({"status": f"upstream answers {reply.status_code}"}, 503)
    return JSONResponse({"status": "ok"})


async def metrics_route(request: Request) -> Response:
    body, content_type = metrics_payload()
    return Response(body, media_type=content_type)


def create_app(settings: CaptureSettings, writer: CaptureWriter) -> Starlette:
    """The pass-through app; it starts and stops ``writer`` with itself."""

    @asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=settings.capture_max_connections,
                              max_keepalive_connections=min(settings.capture_max_connections, 64))
        timeout = httpx.Timeout(settings.capture_read_timeout_s, connect=settings.capture_connect_timeout_s)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            app.state.client = client
            writer.start()
            try:
                yield
            finally:
                await asyncio.shield(writer.stop())

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
