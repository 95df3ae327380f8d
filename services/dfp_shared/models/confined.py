"""Work on untrusted files in a child process with a memory ceiling and a wall-time budget.

A file a user names may claim sizes its bytes do not hold; whatever believes a claim before it is bounded
can allocate without end or loop. What parses such a file runs here: :func:`run_confined` starts
``python -m dfp_shared.models.confined`` in its own session, which imports the function, caps its own address
space with ``RLIMIT_AS`` at its size once imported plus :attr:`Limits.memory_bytes` (so its peak never
reaches the worker), runs it and writes a JSON answer. The parent waits, calling ``check`` every
:data:`CHECK_S` (a cancel, a second SIGTERM: what it raises propagates); the child's process group is
killed with ``SIGKILL`` when ``check`` raises, when the budget's :attr:`Limits.seconds` pass, and when the
parent is interrupted. Arguments and answers are JSON (the answer read at most :data:`MAX_ANSWER_BYTES`
long): no object crosses the boundary. The template renderer (:mod:`dfp_tokenizer.render_process`) does the
same for chat templates with a reused process; this is the one-shot form for files.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CHECK_S = 0.25
MAX_ANSWER_BYTES = 1 << 20
KILL_WAIT_S = 10.0
OUT_OF_MEMORY = 3
RESERVE_BYTES = 32 << 20
"""The child's exit status when it had no memory left to answer."""


@dataclass(frozen=True)
class Limits:
    """What one confined run may spend (the operator's settings)."""

    memory_bytes: int  # address space beyond the child's size once its modules are imported
    seconds: float  # wall time from start (imports included)


class ConfinedError(Exception):
    """The function raised: ``kind`` is its exception's class name, ``message`` its text."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class LimitExceeded(ConfinedError):
    """The child was stopped at a limit: ``kind`` is ``memory``, ``time`` or ``died`` (a signal ended it)."""


@dataclass(frozen=True)
class Outcome:
    value: object
    peak_rss_bytes: int  # the child's peak resident memory (its own report; else an upper bound from the wait)
    seconds: float


def run_confined(target: str, kwargs: dict, limits: Limits, *, preload: tuple[str, ...] = (),
                 check: Callable[[], None] | None = None) -> Outcome:
    """``module:function(**kwargs)`` in a confined child (see the module); modules in ``preload`` are imported
    before the ceiling is set. Raises :class:`LimitExceeded` or :class:`ConfinedError`, or what ``check`` raises."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env.setdefault("MALLOC_ARENA_MAX", "2")  # per-thread arenas reserve address space the ceiling counts
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dfp-confined-") as tmp:
        answer = Path(tmp) / "answer.json"
        request = json.dumps({"target": target, "kwargs": kwargs, "preload": list(preload),
                              "memory_bytes": int(limits.memory_bytes), "answer": str(answer)})
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, env=env,
                                start_new_session=True)
        try:
            proc.stdin.write(request.encode())
            proc.stdin.close()
            status, usage = _wait(proc, started + limits.seconds, check)
        finally:
            if proc.returncode is None:
                _kill(proc)
        seconds = time.monotonic() - started
        peak = usage.ru_maxrss * 1024
        if status is None:
            raise LimitExceeded("time", f"still running after {limits.seconds:g} s (peak {peak >> 20} MiB)")
        return _answer(answer, status, peak, seconds, limits)


def _wait(proc: subprocess.Popen, deadline: float, check: Callable[[], None] | None):
    """(wait status, rusage) once the child ends; (None, rusage) after killing it at ``deadline``."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return status, usage
        if time.monotonic() >= deadline:
            return None, _kill(proc)
        if check is not None:
            check()
        time.sleep(CHECK_S)


def _kill(proc: subprocess.Popen):
    """SIGKILL the child's process group and reap the child; its rusage."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        try:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already
            return resource.getrusage(resource.RUSAGE_CHILDREN)
        if pid or time.monotonic() > deadline:
            proc.returncode = os.waitstatus_to_exitcode(status) if pid else -signal.SIGKILL
            return usage
        time.sleep(0.02)


def _answer(path: Path, status: int, peak: int, seconds: float, limits: Limits) -> Outcome:
    code = os.waitstatus_to_exitcode(status)
    reply = None
    if path.is_file() and path.stat().st_size <= MAX_ANSWER_BYTES:
        try:
            reply = json.loads(path.read_text())
        except ValueError:
            reply = None
    if reply is None and code == OUT_OF_MEMORY:
        raise LimitExceeded("memory", f"needed more than its memory limit of {limits.memory_bytes >> 20} MiB")
    if reply is None:
        why = f"signal {-code}" if code < 0 else f"exit status {code}"
        raise LimitExceeded("died", f"the confined process ended with {why} and no answer (peak {peak >> 20} MiB)")
    if "value" in reply:  # its own peak (the wait's figure may include the parent's size when it forked)
        return Outcome(reply["value"], int(reply.get("peak_rss") or peak), seconds)
    if reply["kind"] == "MemoryError" or reply.get("at_ceiling") or "allocate" in reply["message"]:
        raise LimitExceeded("memory", f"needed more than its memory limit of {limits.memory_bytes >> 20} MiB")
    raise ConfinedError(reply["kind"], reply["message"])


def _address_space() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    return 0


def _peak_address_space() -> int:
    return _status_bytes("VmPeak")


def _child() -> None:
    request = json.loads(sys.stdin.read())
    module, name = request["target"].split(":")
    fn = getattr(importlib.import_module(module), name)
    for extra in request["preload"]:
        importlib.import_module(extra)
    ceiling = _address_space() + int(request["memory_bytes"])
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (ceiling if hard == resource.RLIM_INFINITY else min(ceiling, hard), hard))
    failure, reserve = None, bytearray(RESERVE_BYTES)  # freed first on failure: room to answer in
    try:
        reply = {"value": fn(**request["kwargs"])}
        reply["peak_rss"] = _status_bytes("VmHWM")
    except BaseException as exc:  # noqa: BLE001 - whatever the file provoked is the answer
        del reserve
        failure = (type(exc).__name__, _text(exc))
    if failure is not None:  # (outside the handler: the failed work's frames, and its memory, are gone)
        # a failed allocation surfaces as whatever the library makes of it (MemoryError, a RuntimeError, a
        # SystemError): an address space that reached the last eighth of the budget says what it was
        near = _peak_address_space() >= ceiling - int(request["memory_bytes"]) // 8
        reply = {"kind": failure[0], "message": failure[1], "at_ceiling": near}
    try:
        Path(request["answer"]).write_text(json.dumps(reply))
    except MemoryError:
        os._exit(OUT_OF_MEMORY)


def _text(exc: BaseException) -> str:
    try:
        return str(exc)[:8000]
    except MemoryError:
        return "(no memory left to describe it)"

if __name__ == "__main__":
    _child()
