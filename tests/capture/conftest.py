"""Real servers on loopback for the capture tests: the fake upstream and the pass-through in front of it."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from dfp_capture.service import build_app
from dfp_capture.settings import CaptureSettings
from prometheus_client import REGISTRY

from .fake_upstream import make_app


class LoopbackServer:
    """An ASGI app under uvicorn in a thread, on a free loopback port (lifespan on)."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_config=None, access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> LoopbackServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def upstream():
    server = LoopbackServer(make_app()).start()
    yield server
    server.stop()


@pytest.fixture
def capture(upstream, tmp_path):
    """``capture(**settings)``: a started pass-through in front of ``upstream`` writing to ``tmp_path/capture``."""
    started = []

    def start(store=None, **fields) -> LoopbackServer:
        values = dict(storage_url=f"file://{tmp_path}", capture_upstream=upstream.url,
                      capture_prefix=f"file://{tmp_path}/capture", capture_flush_interval_s=0.05,
                      capture_worker="test")
        values.update(fields)
        server = LoopbackServer(build_app(CaptureSettings(**values), store)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def written_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def records(root: Path) -> list[dict]:
    return [json.loads(line) for p in written_files(root) if p.suffix == ".jsonl"
            for line in p.read_text().splitlines()]


def wait_records(root: Path, count: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = records(root)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def counter(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0
