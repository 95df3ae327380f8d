"""A small supervisor for local service processes (the demo and the end-to-end tests).

Starts named commands with their own environment and log file, and stops every one of them at
the end — on normal exit, on an exception and on Ctrl-C — first with SIGTERM (the services
drain), then SIGKILL. Processes are started in their own process groups so that a service's
children (worker pool processes, torchrun ranks) are stopped with it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ManagedProcess:
    name: str
    cmd: list[str]
    env: dict
    log_path: Path
    cwd: str | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def die_with_parent() -> None:
    """In the child before exec (Linux): receive SIGTERM when the supervisor dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ProcessGroup:
    """Named local processes, all stopped by :meth:`stop_all` (also usable as a context manager)."""

    def __init__(self, log_dir: str | os.PathLike):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, ManagedProcess] = {}

    def start(self, name: str, cmd: list[str], env: dict | None = None, cwd: str | None = None) -> ManagedProcess:
        """Start ``cmd`` as ``name`` (a second start of a running name is an error)."""
        if name in self.procs and self.procs[name].alive():
            raise RuntimeError(f"process {name} is already running")
        mp = self.procs.get(name) or ManagedProcess(name, list(cmd), dict(env or os.environ),
                                                     self.log_dir / f"{name}.log")
        mp.cmd, mp.env, mp.cwd = list(cmd), dict(env or mp.env), cwd or mp.cwd
        if mp.cwd:
            Path(mp.cwd).mkdir(parents=True, exist_ok=True)
        log = open(mp.log_path, "ab")
        mp.proc = subprocess.Popen(mp.cmd, env=mp.env, cwd=mp.cwd, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=die_with_parent if sys.platform == "linux" else None)
        log.close()
        self.procs[name] = mp
        return mp

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process's whole group and wait for the leader to exit."""
        mp = self.procs[name]
        if mp.alive():
            try:
                os.killpg(mp.proc.pid, sig)
            except ProcessLookupError:
                pass
            mp.proc.wait()

    def restart(self, name: str, sig: int = signal.SIGKILL) -> ManagedProcess:
        self.kill(name, sig)
        mp = self.procs[name]
        mp.restarts += 1
        return self.start(name, mp.cmd, mp.env)

    def check_alive(self, *names: str) -> None:
        """Raise with the log tail of the first named process that has exited."""
        for name in names or list(self.procs):
            mp = self.procs[name]
            if not mp.alive():
                raise RuntimeError(f"process {name} exited with {mp.proc.returncode}:\n{mp.log_tail()}")

    def stop_all(self, timeout: float = 20.0) -> None:
        """SIGTERM every group, wait up to ``timeout``, then SIGKILL what is left."""
        live = [mp for mp in self.procs.values() if mp.alive()]
        for mp in live:
            try:
                os.killpg(mp.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for mp in live:
            try:
                mp.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for mp in self.procs.values():
            try:
                os.killpg(mp.proc.pid, signal.SIGKILL)  # the group's leftovers too
            except (ProcessLookupError, PermissionError):
                pass
            if mp.proc:
                mp.proc.wait()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
