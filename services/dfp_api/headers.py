"""Limits on a request's head: its size in bytes and its number of headers, enforced as it arrives.

The HTTP parser buffers a header until it ends, so a 64 MiB header would be read (and parsed, and
copied) whole before any route could look at it. :class:`HeaderLimitedProtocol` is uvicorn's
httptools protocol that counts the bytes of a request's head as they come in and answers
``431 Request Header Fields Too Large`` (then closes the connection) as soon as the head passes
``DFLASH_MAX_HEADER_BYTES`` or its headers pass ``DFLASH_MAX_HEADERS``; nothing past the limit is
parsed. A head must also be complete within ``DFLASH_HEAD_TIMEOUT_S`` of the connection's start (or of its
first byte, for a later request on a kept-alive connection): a connection that sends nothing, or half a head,
gets ``408`` and is closed (idle kept-alive connections close after uvicorn's keep-alive timeout). A connection
past the process's cap (``DFLASH_MAX_CONNECTIONS``, uvicorn's ``limit_concurrency``) is closed as it opens. The
limits are read from the environment when the module loads (``api serve`` exports its
settings there before uvicorn starts its workers).
"""

from __future__ import annotations

import json
import os

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .quotas import REFUSALS

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_HEADERS = 100
DEFAULT_HEAD_TIMEOUT_S = 5.0


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


class HeaderLimitedProtocol(HttpToolsProtocol):
    max_header_bytes = _env_int("DFLASH_MAX_HEADER_BYTES", DEFAULT_MAX_HEADER_BYTES)
    max_headers = _env_int("DFLASH_MAX_HEADERS", DEFAULT_MAX_HEADERS)
    head_timeout_s = _env_float("DFLASH_HEAD_TIMEOUT_S", DEFAULT_HEAD_TIMEOUT_S)

    _in_head = True
    _head_bytes = 0
    _refused = False
    _too_many = False
    _head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            REFUSALS.labels("connections").inc()
            self._refused = True
            transport.close()  # over the process's cap: nothing is read from it
            return
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

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
        self._too_many = False
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.max_headers:
            self._too_many = True
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        if self._too_many:
            return self._refuse(f"request has more than {self.max_headers} headers (DFLASH_MAX_HEADERS)")
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()

    def _refuse(self, message: str, status: int = 431, error: str = "headers_too_large",
                reason: str = "request_head") -> None:
        self._refused = True
        self._disarm_head_timer()
        REFUSALS.labels(reason).inc()
        body = json.dumps({"error": error, "message": message}).encode()
        self.transport.write(b"".join([
            STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n", b"connection: close\r\n\r\n", body]))
        self.transport.close()
