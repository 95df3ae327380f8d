"""Limits on a request's head: its size in bytes and its number of headers, enforced as it arrives.

The HTTP parser buffers a header until it ends, so a 64 MiB header would be read (and parsed, and
copied) whole before any route could look at it. :class:`HeaderLimitedProtocol` is uvicorn's
httptools protocol that counts the bytes of a request's head as they come in and answers
``431 Request Header Fields Too Large`` (then closes the connection) as soon as the head passes
``DFLASH_MAX_HEADER_BYTES`` or its headers pass ``DFLASH_MAX_HEADERS``; nothing past the limit is
parsed. The limits are read from the environment when the module loads (``api serve`` exports its
settings there before uvicorn starts its workers).
"""

from __future__ import annotations

import json
import os

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .quotas import REFUSALS

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_HEADERS = 100


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class HeaderLimitedProtocol(HttpToolsProtocol):
    max_header_bytes = _env_int("DFLASH_MAX_HEADER_BYTES", DEFAULT_MAX_HEADER_BYTES)
    max_headers = _env_int("DFLASH_MAX_HEADERS", DEFAULT_MAX_HEADERS)

    _in_head = True
    _head_bytes = 0
    _refused = False
    _too_many = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._in_head:
            return super().data_received(data)
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

    def _refuse(self, message: str) -> None:
        self._refused = True
        REFUSALS.labels("request_head").inc()
        body = json.dumps({"error": "headers_too_large", "message": message}).encode()
        self.transport.write(b"".join([
            STATUS_LINE[431], b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n", b"connection: close\r\n\r\n", body]))
        self.transport.close()
