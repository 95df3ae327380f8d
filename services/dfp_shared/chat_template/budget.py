"""Time and memory budgets for chat-template rendering, enforced from outside the rendering thread.

A chat template is Jinja code from the spec or from the tokenizer's files, i.e. from a user. Jinja's
sandbox stops it from reaching Python's internals, not from looping for hours (nested ``range``
loops) or doubling a string until the machine runs out of memory. So every render runs under
:meth:`Watchdog.run`: the call registers a deadline, the process's resident memory at the start
plus a budget, and optionally a ``check`` (the job's cancel and the worker's abort); one watchdog
thread per process samples the resident memory every ``TICK_S`` and raises
:class:`BudgetExceeded` *in the rendering thread* (CPython's asynchronous exception) when the
deadline passes or the memory grows past the budget, and re-raises whatever ``check`` raised
(``TaskCancelled``, ``WorkerAborted``) when it stops. Rendering is Python bytecode (Jinja compiles
to Python), so the exception lands within a few bytecodes; nothing in between can catch it
(:class:`BudgetExceeded` is a ``BaseException``, and templates have no ``try``). One C-level
operation cannot be interrupted: :mod:`.sandbox` refuses those that would be too large
before they run, raising :class:`BudgetExceeded` itself, which passes with its own reason.

Costs nothing measurable per render: a dictionary entry under a lock; the thread wakes every
``TICK_S`` and reads ``/proc/self/statm``. One exception per registration, never after it ends.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TICK_S = 0.02
CHECK_EVERY_S = 0.5


class BudgetExceeded(BaseException):  # noqa: N818 - raised into a thread, like KeyboardInterrupt
    """A render ran past its time or memory budget (or was stopped by its ``check``)."""


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc


def _interrupt(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in the thread at its next bytecode (None: withdraw one still pending)."""
    _set_async_exc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)


@dataclass
class _Armed:
    seconds: float
    deadline: float
    rss_limit: int
    memory_bytes: int
    check: Callable[[], None] | None
    next_check: float
    fired: bool = False
    reason: str = ""
    cause: BaseException | None = None
    started: float = field(default_factory=time.monotonic)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):  # not Linux: no memory budget
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class Watchdog:
    """One per process (see :func:`watchdog`): the thread that interrupts renders over budget."""

    def __init__(self, tick_s: float = TICK_S):
        self.tick_s = tick_s
        self._lock = threading.Lock()
        self._armed: dict[int, _Armed] = {}
        self._wake = threading.Event()
        self.rss = _rss_bytes()
        self._thread = threading.Thread(target=self._loop, name="render-watchdog", daemon=True)
        self._thread.start()

    def run(self, fn: Callable, *args, seconds: float, memory_bytes: int, check: Callable[[], None] | None = None):
        """``fn(*args)``, interrupted with :class:`BudgetExceeded` after ``seconds`` or once the process
        holds ``memory_bytes`` more than when it started; ``check()`` is called every
        ``CHECK_EVERY_S`` from the watchdog and what it raises is raised here instead."""
        tid = threading.get_ident()
        now = time.monotonic()
        entry = _Armed(seconds, now + seconds, self.rss + memory_bytes if self.rss else 0, memory_bytes, check,
                       now + CHECK_EVERY_S)
        try:
            try:
                with self._lock:
                    self._armed[tid] = entry
                self._wake.set()
                return fn(*args)
            finally:
                self._disarm(tid, entry)
        except BudgetExceeded:
            self._disarm(tid, entry)
            if not entry.fired:  # raised by the render itself: its own reason
                raise
            if entry.cause is not None:
                raise entry.cause from None
            raise BudgetExceeded(entry.reason or "render stopped") from None

    def _disarm(self, tid: int, entry: _Armed) -> None:
        with self._lock:
            if self._armed.get(tid) is entry:
                del self._armed[tid]
            fired = entry.fired
        if fired:  # fired as the call returned: drop the exception if it is still pending
            _interrupt(tid, None)

    def _fire(self, tid: int, entry: _Armed, reason: str, cause: BaseException | None = None) -> None:
        """(under the lock) one exception per registration."""
        entry.fired, entry.reason, entry.cause = True, reason, cause
        _interrupt(tid, BudgetExceeded)

    def _loop(self) -> None:
        while True:
            if not self._armed:
                self._wake.wait(0.2)
                self._wake.clear()
            time.sleep(self.tick_s)
            self.rss = _rss_bytes()
            now = time.monotonic()
            with self._lock:
                live = [(tid, e) for tid, e in self._armed.items() if not e.fired]
            checks = []
            with self._lock:
                over_memory = [(e.rss_limit, tid, e) for tid, e in live if e.rss_limit and self.rss > e.rss_limit]
                if over_memory:  # the earliest-started render is the likeliest to hold it
                    _, tid, e = min(over_memory, key=lambda x: x[2].started)
                    if self._armed.get(tid) is e:
                        self._fire(tid, e, f"went over its memory budget of {e.memory_bytes / 2**20:g} MiB")
                for tid, e in live:
                    if e.fired or self._armed.get(tid) is not e:
                        continue
                    if now > e.deadline:
                        self._fire(tid, e, f"ran past its time budget of {e.seconds:g} s")
                    elif e.check is not None and now >= e.next_check:
                        e.next_check = now + CHECK_EVERY_S
                        checks.append((tid, e))
            for tid, e in checks:  # outside the lock: a Redis round trip
                try:
                    e.check()
                except BaseException as exc:  # noqa: BLE001 - re-raised in the rendering thread
                    with self._lock:
                        if self._armed.get(tid) is e and not e.fired:
                            self._fire(tid, e, "stopped", exc)


_watchdog: Watchdog | None = None
_create_lock = threading.Lock()


def _after_fork() -> None:  # threads do not survive a fork: the child starts its own watchdog
    global _watchdog, _create_lock
    _watchdog, _create_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def watchdog() -> Watchdog:
    """This process's watchdog, started on first use."""
    global _watchdog
    if _watchdog is None:
        with _create_lock:
            if _watchdog is None:
                _watchdog = Watchdog()
    return _watchdog


def run_within(fn: Callable, *args, seconds: float, memory_bytes: int, check: Callable[[], None] | None = None):
    """:meth:`Watchdog.run` on this process's watchdog."""
    return watchdog().run(fn, *args, seconds=seconds, memory_bytes=memory_bytes, check=check)
