"""A small HTTP/1.1 client for the one upstream: one connection a request, replies parsed by ``httptools``
(uvicorn's parser) and their body handed on as the bytes arrive.

The relay's cost is per chunk of every stream, so this client does as little as it can per chunk: the
socket's bytes go through the C parser straight into the reply's buffer, with no per-read task or timeout
context. A reply's body is the upstream's bytes, de-chunked and never decoded (the request asks for
``Accept-Encoding: identity``).

A connection carries one request and its reply, never another: the request says ``connection: close``, and
the connection is closed once its reply is done with (after the upstream's own close, if that comes within
``LINGER_S``, so the upstream's side keeps the closed connection's ``TIME_WAIT``). Whatever an upstream sends
past a reply's end, sooner or later, can only reach the request it was sent on: on a kept-alive connection
bytes sent after a reply's end cannot be told apart from the next request's reply once that request is
written. So nothing is sent twice either: a request whose connection fails is not sent again.

What an upstream can send is bounded: a reply's head (interim ``1xx`` heads included, which are skipped) up
to ``MAX_HEAD_BYTES`` and ``MAX_HEADERS`` headers, complete within the read timeout of its first head's first
byte; trailers up to ``MAX_TRAILER_BYTES`` (read, never kept); bytes after a reply's end close its
connection. At most ``max_connections`` requests are in flight: one more waits up to the connect timeout for a
slot, then is refused (:class:`UpstreamBusy`); the readiness probe has a slot of its own.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

import httptools

PAUSE_BYTES = 256 * 1024  # a reply's unread bytes past which the upstream connection stops being read
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
MAX_TRAILER_BYTES = 8 * 1024
LINGER_S = 2.0  # how long a done connection waits for the upstream to close it before it is closed here


class UpstreamError(Exception):
    """The upstream could not be reached, went silent past the read timeout, or broke off its reply."""


class UpstreamBusy(UpstreamError):
    """Every connection to the upstream stayed taken for the connect timeout."""


class UpstreamTimeout(UpstreamError):
    """The upstream was silent past the read timeout, or its reply head took longer."""


class Reply:
    """One reply as it arrives: ``status`` and ``headers`` (raw byte pairs) once ``head`` is done, then
    :meth:`body` yields the body's bytes as they come."""

    def __init__(self, conn: Connection, read_timeout: float, bodyless: bool = False):
        """``bodyless``: the reply to a HEAD request, whose head ends it whatever its framing headers say."""
        self.conn, self.read_timeout, self.bodyless = conn, read_timeout, bodyless
        self.loop = conn.loop
        self.parser = httptools.HttpResponseParser(self)
        self.head = self.loop.create_future()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.pending: deque[bytes] = deque()
        self.buffered = 0
        self.waiter: asyncio.Future | None = None
        self.received = False
        self.done = False
        self.until_close = False
        self.error: Exception | None = None
        self.slots: asyncio.Semaphore | None = None  # the one the reply's slot is given back to
        self.interim = False
        self.head_read = 0  # bytes read while the head was not complete (interim heads included)
        self.head_since: float | None = None  # the first byte of the first head: interim heads do not reset it
        self.head_bytes = self.trailer_bytes = 0
        self.seen = self.loop.time()
        self.timer = self.loop.call_later(read_timeout, self._check_silence)

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.done:
            raise UpstreamError("bytes after the reply's end")

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 4
        if self.head.done():  # a trailer: read, not kept
            self.trailer_bytes += size
            if self.trailer_bytes > MAX_TRAILER_BYTES:
                raise UpstreamError(f"trailers past {MAX_TRAILER_BYTES} bytes")
            return
        self.head_bytes += size
        self.headers.append((name, value))
        if len(self.headers) > MAX_HEADERS or self.head_bytes > MAX_HEAD_BYTES:
            raise UpstreamError(f"a reply head past {MAX_HEADERS} headers or {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200 and self.status != 101:  # an interim reply: the final one follows
            self.interim = True
            self.headers = []
            return
        names = {name.lower() for name, _ in self.headers}
        # 204 and 304 replies never have a body (the parser ends them at their head, and what follows is bytes after
        # the reply's end); any other without a length or chunking runs to the connection's end
        self.until_close = (self.status not in (204, 304) and b"content-length" not in names
                            and b"transfer-encoding" not in names)
        if not self.head.done():
            self.head.set_result(None)
        if self.bodyless:  # the reply to a HEAD: ends at its head, whatever length it announces
            self.done = True
            self.timer.cancel()

    def on_body(self, body: bytes) -> None:
        if self.done:  # a HEAD reply's body
            raise UpstreamError("bytes after the reply's end")
        self.pending.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.done = True
        self.timer.cancel()

    # fed by the connection
    def feed(self, data: bytes) -> None:
        self.received = True
        self.seen = self.loop.time()
        if not self.head.done():
            self.head_read += len(data)
            if self.head_since is None:
                self.head_since = self.seen
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:  # past the reply's end, the reply stands and the bytes go unread
            cause = exc.__context__
            self.fail(cause if isinstance(cause, UpstreamError) else UpstreamError(f"unreadable reply: {exc}"))
            self.conn.close()
            return
        if not self.head.done() and self.head_read > MAX_HEAD_BYTES:
            self.fail(UpstreamError(f"a reply head past {MAX_HEAD_BYTES} bytes"))
            self.conn.close()
            return
        if self.buffered > PAUSE_BYTES:
            self.conn.pause()
        self._wake()

    def lost(self, exc: Exception | None) -> None:
        if self.done:
            return
        if self.until_close and self.head.done() and exc is None:  # a body delimited by the connection's end
            self.done = True
            self.timer.cancel()
            self._wake()
            return
        self.fail(UpstreamError(f"the upstream closed the connection{f': {exc}' if exc else ''}"))

    def fail(self, error: Exception) -> None:
        if self.done or self.error is not None:
            return
        self.error = error
        self.timer.cancel()
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # retrieved here: a head nobody awaits any more is not an error to log
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _check_silence(self) -> None:
        now = self.loop.time()
        left = self.read_timeout - (now - self.seen)
        slow_head = self.head_since is not None and not self.head.done()
        if slow_head:
            left = min(left, self.read_timeout - (now - self.head_since))
        if left > 0:
            self.timer = self.loop.call_later(left, self._check_silence)
            return
        what = "the reply head took longer than" if slow_head else "the upstream was silent for"
        self.fail(UpstreamTimeout(f"{what} {self.read_timeout:g} s"))
        self.conn.close()

    async def body(self):
        """The body's bytes as they arrive (what one read brought, joined); raises :class:`UpstreamError`
        when the reply breaks off."""
        pending = self.pending
        while True:
            if pending:
                data = pending.popleft() if len(pending) == 1 else b"".join(pending)
                pending.clear()
                self.buffered = 0
                self.conn.resume()
                yield data
            elif self.done:
                return
            elif self.error is not None:
                raise self.error
            else:
                self.waiter = self.loop.create_future()
                await self.waiter
                self.waiter = None

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.body()])

    def abort(self, error: Exception) -> None:
        """Stop the reply (its connection is closed, not reused)."""
        self.fail(error)
        self.conn.close()


class Connection(asyncio.Protocol):
    """One connection, one request: bytes that arrive with no reply reading, or past its reply's end, close it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.reply: Reply | None = None
        self.closed = False
        self.paused = False
        self.on_close = None  # called once the connection is closed, whoever closed it

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply is None or reply.done:  # bytes nobody asked for: they go unread, with the connection
            self.close()
            return
        reply.feed(data)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.reply is not None:
            self.reply.lost(exc)
        self._closed()

    def pause(self) -> None:
        if not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.abort()
            self._closed()

    def _closed(self) -> None:
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()


class UpstreamClient:
    """Requests to one base URL (``http://`` or ``https://``, with an optional path prefix), at most
    ``max_connections`` at once, each on a connection of its own."""

    def __init__(self, base_url: str, *, max_connections: int, connect_timeout: float, read_timeout: float):
        url = urlsplit(base_url)
        self.tls = url.scheme == "https"
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if self.tls else 80)
        self.prefix = url.path.rstrip("/")
        default_port = (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = (host if self.port == default_port else f"{host}:{self.port}").encode("latin-1")
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.ssl = ssl.create_default_context() if self.tls else None
        self.slots = asyncio.Semaphore(max_connections)
        self.probe_slots = asyncio.Semaphore(1)  # the readiness probe's own, never behind the requests
        self.closing: set[Connection] = set()  # done connections waiting for the upstream to close them

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: Connection(loop), self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.tls else None), self.connect_timeout)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {type(exc).__name__}: {exc}") from None
        return conn

    def _head(self, method: str, target: bytes, headers, body: bytes | None) -> bytes:
        lines = [method.encode("ascii"), b" ", self.prefix.encode("latin-1"), target, b" HTTP/1.1\r\nhost: ",
                 self.host_header, b"\r\nconnection: close\r\n"]
        for name, value in headers:
            lines += [name, b": ", value, b"\r\n"]
        if body is not None:
            lines += [b"content-length: ", str(len(body)).encode("ascii"), b"\r\n"]
        lines.append(b"\r\n")
        if body:
            lines.append(body)
        return b"".join(lines)

    async def _acquire(self, slots: asyncio.Semaphore) -> None:
        if not slots.locked():
            await slots.acquire()
            return
        try:
            await asyncio.wait_for(slots.acquire(), self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamBusy(f"every upstream connection stayed busy for {self.connect_timeout:g} s") from None

    async def request(self, method: str, target: bytes, headers, body: bytes | None = None,
                      probe: bool = False) -> Reply:
        """Send a request (``headers``: byte pairs, without host, connection and content-length) on a connection
        of its own and wait for the reply's head; :meth:`release` the reply once done with it. Sent once: a
        failure after the connection was made is the caller's (:class:`UpstreamTimeout` for a silent upstream).
        ``probe``: on the readiness probe's own slot."""
        slots = self.probe_slots if probe else self.slots
        await self._acquire(slots)
        conn = None
        try:
            data = self._head(method, target, headers, body)
            conn = await self._connect()
            reply = conn.reply = Reply(conn, self.read_timeout, bodyless=method == "HEAD")
            reply.slots = slots
            conn.transport.write(data)
            await reply.head
            return reply
        except BaseException:
            if conn is not None:
                if conn.reply is not None:
                    conn.reply.timer.cancel()
                conn.close()
            slots.release()
            raise

    def release(self, reply: Reply) -> None:
        """The reply is done with: its connection is closed (a whole reply's once the upstream closed it, or
        ``LINGER_S`` later)."""
        conn = reply.conn
        reply.timer.cancel()
        conn.reply = None
        if reply.done and reply.error is None and not conn.closed:
            conn.resume()
            self.closing.add(conn)
            timer = conn.loop.call_later(LINGER_S, conn.close)
            conn.on_close = lambda: (timer.cancel(), self.closing.discard(conn))
        else:
            conn.close()
        reply.slots.release()

    async def fetch(self, method: str, target: bytes, headers, timeout: float,
                    probe: bool = False) -> tuple[int, bytes]:
        """A whole short reply (status, body) within ``timeout`` seconds."""
        async def whole():
            reply = await self.request(method, target, headers, probe=probe)
            try:
                return reply.status, await reply.read()
            finally:
                self.release(reply)
        try:
            return await asyncio.wait_for(whole(), timeout)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"no reply within {timeout:g} s") from None

    def close(self) -> None:
        for conn in list(self.closing):
            conn.close()
