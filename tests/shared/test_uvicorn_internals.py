"""The API's request-head limits subclass uvicorn's httptools protocol and write its status lines, neither of
which is uvicorn's public API: the names they import, the methods they override (with their signatures),
the attributes they read and the status lines they send are checked here, so that a uvicorn release that
moves them fails this file before the limits break. pyproject.toml keeps uvicorn below its next minor
version; raising that bound starts here."""

from __future__ import annotations

import asyncio
import inspect
import re
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
# the methods the limits override, each with the parameters it is called with
OVERRIDDEN = {
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "data_received": ["self", "data"],
    "on_message_begin": ["self"],
    "on_header": ["self", "name", "value"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
}


def test_uvicorn_is_bounded_and_the_installed_one_is_within_the_bound():
    line = re.search(r'^\s*"(uvicorn\[[^"]*)",', PYPROJECT.read_text(), re.M).group(1)
    requirement = Requirement(line)
    assert any(spec.operator == "<" for spec in requirement.specifier), f"{line}: no upper bound"
    assert requirement.specifier.contains(version("uvicorn")), (line, version("uvicorn"))


def test_the_protocol_defines_every_overridden_method_with_its_signature():
    for name, params in OVERRIDDEN.items():
        method = HttpToolsProtocol.__dict__.get(name)  # its own, not asyncio.Protocol's empty one
        assert callable(method), f"HttpToolsProtocol no longer defines {name}"
        signature = inspect.signature(method)
        assert list(signature.parameters) == params, (name, signature)
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
                   for p in signature.parameters.values()), (name, signature)


def test_status_lines_of_the_refusals():
    assert STATUS_LINE[408] == b"HTTP/1.1 408 Request Timeout\r\n"
    assert STATUS_LINE[431] == b"HTTP/1.1 431 Request Header Fields Too Large\r\n"


class _Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.written, self.closed = b"", False

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class _Recording(HttpToolsProtocol):
    """Overrides a parser callback as the limits do: the parser binds the class's methods when it is made."""

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self.seen.append(list(self.headers))


def test_the_attributes_the_limits_read_and_a_request_fed_in_pieces():
    """``limit_concurrency``, ``connections``, ``loop`` and ``transport`` on the protocol, the request's
    ``headers`` as (name, value) pairs growing header by header, and a request head fed in pieces answered."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def serve() -> tuple[_Recording, _Transport]:
        config = Config(app=app, http="httptools", limit_concurrency=7, log_level="warning", lifespan="off")
        protocol = _Recording(config=config, server_state=ServerState(), app_state={},
                              _loop=asyncio.get_running_loop())
        protocol.seen = []
        assert protocol.limit_concurrency == 7 and protocol.loop is asyncio.get_running_loop()
        transport = _Transport()
        protocol.connection_made(transport)
        assert protocol.transport is transport and protocol in protocol.connections
        for piece in (b"GET /x HTTP/1.1\r\nHo", b"st: a\r\nX-One: 1\r\n", b"\r\n"):
            protocol.data_received(piece)
        for _ in range(1000):  # the app's task answers on the loop
            if b"ok" in transport.written:
                break
            await asyncio.sleep(0.01)
        protocol.connection_lost(None)
        return protocol, transport

    protocol, transport = asyncio.run(serve())
    assert protocol.seen == [[(b"host", b"a")], [(b"host", b"a"), (b"x-one", b"1")]]
    assert transport.written.startswith(STATUS_LINE[200]) and transport.written.endswith(b"\r\n\r\nok")
    assert protocol not in protocol.connections


def test_the_request_cycle_says_whether_a_response_began_and_ended():
    """The front door answers a refusal only where no response is being sent: it reads the cycle's flags."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    names = inspect.signature(RequestResponseCycle.__init__).parameters
    assert "transport" in names and "flow" in names
    source = inspect.getsource(RequestResponseCycle.__init__)
    assert "self.response_started = False" in source and "self.response_complete = False" in source
