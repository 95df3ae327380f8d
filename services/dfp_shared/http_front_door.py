"""The HTTP front door of the project's servers (the API, the capture pass-through): what a connection must do,
and how soon, before a request reaches the app.

The HTTP parser buffers a header until it ends, so a 64 MiB header would be read (and parsed, and copied)
whole before any route could look at it. :class:`FrontDoorProtocol` is uvicorn's httptools protocol that
counts the bytes of a request's head as they come in and answers ``431 Request Header Fields Too Large``
(then closes the connection) as soon as the head passes ``DFLASH_MAX_HEADER_BYTES``, or once it ends with
more than ``DFLASH_MAX_HEADERS`` headers; nothing past the limit is parsed. A head must be complete within
``DFLASH_HEAD_TIMEOUT_S`` of the connection's start (or of its first byte, for a later request on a
kept-alive connection; later bytes do not restart the time): a connection that sends nothing, or half a
head, gets ``408`` and is closed; so does one whose body is not complete within ``DFLASH_BODY_TIMEOUT_S`` of its
head's end (a slow or stalled body would hold a connection slot and the bytes read so far). A kept-alive
connection idle between requests is closed after
``DFLASH_KEEP_ALIVE_TIMEOUT_S``. A connection past the process's cap (``DFLASH_MAX_CONNECTIONS``,
uvicorn's ``limit_concurrency``) is closed as it opens, unread. Each refusal is counted, by reason
(``request_head``, ``request_head_timeout``, ``request_body_timeout``, ``connections``), in the server's own
counter.

A server started in this process takes a class with its settings' limits (:func:`front_door_protocol`);
uvicorn's worker processes import the protocol by name, so its class attributes are read from the
environment when this module loads (``api serve`` exports its settings there first).
"""

from __future__ import annotations

import json
import os

from pydantic import Field
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from dfp_shared.config import CommonSettings

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_HEADERS = 100
DEFAULT_HEAD_TIMEOUT_S = 5.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 2048


class FrontDoorSettings(CommonSettings):
    """The front door's limits (``DFLASH_MAX_HEADER_BYTES`` ...), the same names in every server."""

    max_header_bytes: int = Field(
        DEFAULT_MAX_HEADER_BYTES, ge=1024, le=16 * 1024 * 1024,
        description="Largest request head (request line and headers) accepted, in bytes; a larger one is a 431.")
    max_headers: int = Field(DEFAULT_MAX_HEADERS, ge=8, le=10_000,
                             description="Most request headers accepted; more is a 431.")
    head_timeout_s: float = Field(
        DEFAULT_HEAD_TIMEOUT_S, gt=0, le=300, description="Seconds a connection may take to send a complete "
        "request head; then 408 and the connection is closed.")
    body_timeout_s: float = Field(
        DEFAULT_BODY_TIMEOUT_S, gt=0, le=3600, description="Seconds a request's body may take to arrive, from "
        "the end of its head; then 408 and the connection is closed.")
    keep_alive_timeout_s: float = Field(
        DEFAULT_KEEP_ALIVE_TIMEOUT_S, gt=0, le=3600,
        description="Seconds a kept-alive connection may stay idle between requests before it is closed.")
    max_connections: int = Field(
        DEFAULT_MAX_CONNECTIONS, ge=16, le=1_000_000, description="Open connections per server process; one "
        "more is closed as it opens (and a request past it while tasks are busy is a 503).")


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class FrontDoorProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the front door's limits; ``refusals``: the server's counter of
    refusals (a Prometheus counter with a ``reason`` label), or None."""

    max_header_bytes = _env_int("DFLASH_MAX_HEADER_BYTES", DEFAULT_MAX_HEADER_BYTES)
    max_headers = _env_int("DFLASH_MAX_HEADERS", DEFAULT_MAX_HEADERS)
    head_timeout_s = _env_float("DFLASH_HEAD_TIMEOUT_S", DEFAULT_HEAD_TIMEOUT_S)
    body_timeout_s = _env_float("DFLASH_BODY_TIMEOUT_S", DEFAULT_BODY_TIMEOUT_S)
    refusals = None

    _in_head = True
    _head_bytes = 0
    _refused = False
    _head_timer = None
    _body_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            self._count("connections")
            self._refused = True
            transport.close()  # over the process's cap: nothing is read from it
            return
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        super().connection_lost(exc)

    def _count(self, reason: str) -> None:
        if self.refusals is not None:
            self.refusals.labels(reason).inc()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._in_head and not self._refused and not self.transport.is_closing():
            self._refuse(f"request head not complete within {self.head_timeout_s:g} s (DFLASH_HEAD_TIMEOUT_S)",
                         status=408, error="request_timeout", reason="request_head_timeout")

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_late(self) -> None:
        self._body_timer = None
        if not self._in_head and not self._refused and not self.transport.is_closing():
            self._refuse(f"request body not complete within {self.body_timeout_s:g} s (DFLASH_BODY_TIMEOUT_S)",
                         status=408, error="request_timeout", reason="request_body_timeout")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._in_head:
            return super().data_received(data)
        self._arm_head_timer()  # a later request's head: from its first byte
        room = self.max_header_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            return super().data_received(data)
        # past the limit unless the head ends within the room left: feed that much, then see
        self._head_bytes += room
        super().data_received(data[:room])
        if self._refused:
            return
        if self._in_head:
            return self._refuse(f"request head is over the limit of {self.max_header_bytes} bytes "
                                "(DFLASH_MAX_HEADER_BYTES)")
        self.data_received(data[room:])

    def on_message_begin(self) -> None:
        self._arm_head_timer()  # a head that began in the same read as the end of the request before it
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        # counted once the head ends: the byte limit already bounds what the headers hold until then
        if len(self.headers) > self.max_headers:
            return self._refuse(f"request has more than {self.max_headers} headers (DFLASH_MAX_HEADERS)")
        super().on_headers_complete()
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_late)

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm_body_timer()
        if self._refused:
            return
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()

    def _refuse(self, message: str, status: int = 431, error: str = "headers_too_large",
                reason: str = "request_head") -> None:
        self._refused = True
        self._disarm_head_timer()
        self._disarm_body_timer()
        self._count(reason)
        cycle = self.cycle  # answered only where no response is being sent: before it starts or after it ends
        if cycle is None or cycle.response_complete or not cycle.response_started:
            body = json.dumps({"error": error, "message": message}).encode()
            self.transport.write(b"".join([
                STATUS_LINE[status], b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode() + b"\r\n", b"connection: close\r\n\r\n", body]))
        self.transport.close()


def front_door_protocol(settings: FrontDoorSettings, refusals=None) -> type[FrontDoorProtocol]:
    """The protocol class with ``settings``' limits, for a server run in this process; ``refusals``: the
    server's counter of refusals by reason."""
    return type("FrontDoor", (FrontDoorProtocol,), {
        "max_header_bytes": settings.max_header_bytes, "max_headers": settings.max_headers,
        "head_timeout_s": settings.head_timeout_s, "body_timeout_s": settings.body_timeout_s, "refusals": refusals, "__module__": __name__})


def uvicorn_options(settings: FrontDoorSettings, http: str | type[FrontDoorProtocol]) -> dict:
    """uvicorn's settings for a server behind the front door (uvloop, ``http``: the protocol class or its
    import name, the connection cap, the keep-alive timeout, no server header, no log configuration)."""
    return dict(loop="uvloop", http=http, limit_concurrency=settings.max_connections,
                timeout_keep_alive=settings.keep_alive_timeout_s, server_header=False, log_config=None,
                timeout_graceful_shutdown=10)
