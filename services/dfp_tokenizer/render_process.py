"""Chat templates rendered in a child process that the worker kills when a render overruns.

The watchdog (:mod:`dfp_shared.chat_template.budget`) stops a render between bytecodes; one C-level
call that never returns (or allocates gigabytes at once) it can only see. So records are rendered in
a render process (:mod:`.render_child`), started once per worker thread that renders and reused: the
parent sends it a batch of records and reads one answer per record, each within the time budget
plus :data:`GRACE_S` (the child's own watchdog answers over-budget renders with their precise reason
first). An answer that does not come in time, a cancel or abort (``check``, polled every
:data:`CHECK_S` while waiting) or the child's death ends it with ``SIGKILL``: the record in hand is a
``template_budget`` bad line (or the ``check``'s exception propagates), a fresh process is started and
the rest of the batch is sent again (renders are deterministic). The child's memory is capped with
``RLIMIT_AS`` (its size once started plus the memory budget), so its peak never reaches the worker.

Answers are read with an unpickler that resolves no class (plain values only) and at most
:func:`max_answer_bytes` long: a render process that ran foreign code still cannot run any here.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import mmap
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from multiprocessing import Pipe

from .render_child import CHUNK_CHARS, PROGRESS

CHILD_MODULE = "dfp_tokenizer.render_child"
"""The module run as the render process (``python -m``)."""
GRACE_S = 1.0
"""How long after its time budget an answer may come before the render process is killed."""
CHECK_S = 0.5
START_TIMEOUT_S = 120.0
"""A render process that is not ready by then (imports on a loaded machine) fails the task."""


class RenderRefused(Exception):
    """A template the render process cannot build: ``kind`` is ``compile``, ``budget`` or ``error``."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class _Late(Exception):
    pass


class _Gone(Exception):
    pass


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the render process sent a {module}.{name}: only plain values are accepted")


def _plain_loads(data: bytes):
    return _PlainUnpickler(io.BytesIO(data)).load()


@dataclass(frozen=True)
class RenderConfig:
    """What one :class:`~.template_spans.TemplateLocator` is built from, and the budget of its renders."""

    locator_args: dict
    seconds: float
    memory_bytes: int
    max_chars: int

    @cached_property
    def key(self) -> str:
        return hashlib.sha256(pickle.dumps(sorted(self.locator_args.items()), protocol=4)).hexdigest()


def max_answer_bytes(max_chars: int) -> int:
    """The longest answer: a rendered text (UTF-8, at most 4 bytes a character) and its spans (a chunk of
    answers holds at most one past :data:`~.render_child.CHUNK_CHARS` characters)."""
    return 4 * max_chars + 2**20


class RenderChild:
    """One render process and its socket."""

    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        ours, theirs = Pipe(duplex=True)
        progress_fd = os.memfd_create("render-progress")
        os.ftruncate(progress_fd, PROGRESS.size)
        self.progress = mmap.mmap(progress_fd, PROGRESS.size)
        PROGRESS.pack_into(self.progress, 0, -1, 0.0)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        env.setdefault("MALLOC_ARENA_MAX", "2")  # per-thread arenas reserve address space the limit counts
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno()), str(memory_bytes), str(progress_fd)],
                pass_fds=(theirs.fileno(), progress_fd), env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
            os.close(progress_fd)
        self.conn = ours
        self.built: set[str] = set()
        try:
            ready = self.receive(START_TIMEOUT_S, None, 2**16)
        except (_Late, _Gone):
            self.kill()
            raise RuntimeError(f"the render process did not start ({self.exit_reason()})") from None
        if ready[0] != "ready":
            self.kill()
            raise RuntimeError("the render process did not start")
        self.pid = self.proc.pid

    def send(self, value) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            raise _Gone() from None

    def receive(self, seconds: float, check: Callable[[], None] | None, max_bytes: int):
        """The next answer within ``seconds`` (``check()`` called every :data:`CHECK_S`, what it raises
        propagates); raises :class:`_Late` or :class:`_Gone`."""
        now = time.monotonic()
        deadline, next_check = now + seconds, now + CHECK_S
        while True:
            wait = max(0.0, min(deadline, next_check) - now) if check else max(0.0, deadline - now)
            try:
                if self.conn.poll(wait):
                    return _plain_loads(self.conn.recv_bytes(max_bytes))
            except (EOFError, OSError, pickle.UnpicklingError):
                raise _Gone() from None
            now = time.monotonic()
            if check is not None and now >= next_check:
                check()
                now = time.monotonic()
                next_check = now + CHECK_S
            if now >= deadline:
                raise _Late()

    def in_hand(self) -> tuple[int, float]:
        """(index of the record the render process is rendering, -1 if none; when it started, monotonic)."""
        while True:
            index, started = PROGRESS.unpack_from(self.progress, 0)
            if PROGRESS.unpack_from(self.progress, 0)[0] == index:
                return index, started

    def answers(self, seconds: float, check: Callable[[], None] | None, max_bytes: int):
        """The next chunk of answers; raises :class:`_Late` (with the index of the record in hand) once one
        record has been rendering for ``seconds``, or :class:`_Gone`."""
        while True:
            index, started = self.in_hand()
            wait = CHECK_S if index < 0 else min(CHECK_S, max(0.0, started + seconds - time.monotonic()))
            try:
                if self.conn.poll(wait):
                    return _plain_loads(self.conn.recv_bytes(max_bytes))
            except (EOFError, OSError, pickle.UnpicklingError):
                raise _Gone() from None
            if check is not None:
                check()
            index, started = self.in_hand()
            if index >= 0 and time.monotonic() - started >= seconds:
                raise _Late(index)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - stuck in the kernel: reaped later
            pass
        self.conn.close()
        self.progress.close()

    def exit_reason(self) -> str:
        try:
            code = self.proc.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def build(self, config: RenderConfig, check: Callable[[], None] | None) -> None:
        key = config.key
        if key in self.built:
            return
        self.send(("build", key, config.locator_args, config.seconds, config.memory_bytes))
        try:
            answer = self.receive(config.seconds + GRACE_S, check, 2**20)
        except _Late:
            self.kill()
            raise RenderRefused("budget", f"ran past its time budget of {config.seconds:g} s "
                                          "(stopped in one call; the render process was killed)") from None
        if answer[0] == "refused":
            raise RenderRefused(answer[1], answer[2])
        self.built.add(key)


class RenderPool:
    """This process's idle render processes, by memory budget (one per thread that renders at a time)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: dict[int, list[RenderChild]] = {}
        self._all: set[RenderChild] = set()

    def acquire(self, memory_bytes: int) -> RenderChild:
        with self._lock:
            idle = self._idle.get(memory_bytes)
            if idle:
                return idle.pop()
        child = RenderChild(memory_bytes)
        with self._lock:
            self._all.add(child)
        return child

    def release(self, child: RenderChild) -> None:
        with self._lock:
            self._idle.setdefault(child.memory_bytes, []).append(child)

    def discard(self, child: RenderChild) -> None:
        child.kill()
        with self._lock:
            self._all.discard(child)

    def children(self) -> list[RenderChild]:
        with self._lock:
            return list(self._all)

    def close(self) -> None:
        with self._lock:
            children, self._all, self._idle = list(self._all), set(), {}
        for child in children:
            child.kill()

    def forget(self) -> None:
        """(in a forked child) the parent's render processes are not ours: drop them unkilled."""
        for child in self._all:
            try:
                child.conn.close()
            except OSError:
                pass
        self._lock, self._all, self._idle = threading.Lock(), set(), {}


POOL = RenderPool()
atexit.register(POOL.close)
os.register_at_fork(after_in_child=POOL.forget)


def build(config: RenderConfig, check: Callable[[], None] | None = None) -> None:
    """Build the template's locator in a render process (its probes run there); raises
    :class:`RenderRefused`. A process that dies building it is replaced and tried once more."""
    for attempt in (1, 2):
        child = POOL.acquire(config.memory_bytes)
        try:
            child.build(config, check)
        except RenderRefused:
            if child.proc.poll() is None:
                POOL.release(child)
            else:
                POOL.discard(child)
            raise
        except _Gone:
            POOL.discard(child)
            if attempt == 2:
                raise RenderRefused("budget", f"the render process died building it ({child.exit_reason()})") from None
            continue
        except BaseException:
            POOL.discard(child)
            raise
        POOL.release(child)
        return


def render(config: RenderConfig, items: list[tuple[list, list | None]],
           check: Callable[[], None] | None = None) -> list[tuple]:
    """Each ``(messages, tools)`` rendered and located in a render process: ``("ok", text, turns)`` or
    ``("bad", reason, detail)`` per item, in order. What ``check`` raises propagates (the render in hand
    is killed first); so do :class:`RenderRefused` (the template no longer builds) and a render process
    that does not start."""
    from .records import TEMPLATE_BUDGET

    out: list[tuple | None] = [None] * len(items)
    todo = list(range(len(items)))
    max_bytes = max_answer_bytes(config.max_chars) + 8 * CHUNK_CHARS
    while todo:
        child = POOL.acquire(config.memory_bytes)
        keep = False
        try:
            child.build(config, check)
            child.send(("render", config.key, [(i, *items[i]) for i in todo], config.seconds, config.memory_bytes))
            while True:
                chunk, done, stale = child.answers(config.seconds + GRACE_S, check, max_bytes)
                for i, answer in chunk:
                    out[i] = answer
                if done:
                    break
            keep = not stale
        except _Late as late:
            (index,) = late.args
            out[index] = ("bad", TEMPLATE_BUDGET, f"chat template ran past its time budget of {config.seconds:g} s "
                                                   "(stopped in one call; the render process was killed)")
        except _Gone:
            index, _ = child.in_hand()
            if index >= 0 and out[index] is None:
                out[index] = ("bad", TEMPLATE_BUDGET, f"chat template stopped the render process "
                                                       f"({child.exit_reason()}; memory budget "
                                                       f"{config.memory_bytes / 2**20:g} MiB)")
            elif not any(out[i] is None for i in todo):
                pass
            else:  # gone between records: the first one not answered takes the blame, never a loop
                first = next(i for i in todo if out[i] is None)
                out[first] = ("bad", TEMPLATE_BUDGET, f"the render process stopped ({child.exit_reason()})")
        finally:
            if keep:
                POOL.release(child)
            else:
                POOL.discard(child)
        todo = [i for i in todo if out[i] is None]
    return out
