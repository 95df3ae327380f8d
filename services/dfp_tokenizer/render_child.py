"""The render process: chat templates rendered and located where the worker can kill them.

Started by :mod:`.render_process` (``python -m dfp_tokenizer.render_child <fd> <memory bytes>``), one
per worker thread that renders, and reused for every batch. It reads requests from the socket ``fd``
(pickles from its parent: the only side that may send code-bearing objects) and answers with plain
values only (strings, numbers, tuples, lists, None), which the parent reads without resolving any
class:

* ``("build", key, locator_args, seconds, memory_bytes)``: compile a template and run its probes
  (:class:`~.template_spans.TemplateLocator`); answers ``("built",)`` or ``("refused", kind, detail)``
  with ``kind`` one of ``compile``, ``budget``, ``error``;
* ``("render", key, [(index, messages, tools), ...], seconds, memory_bytes)``: an answer per record,
  ``(index, ("ok", text, [(message_index, gen_start, gen_end, reasoning, content), ...]))`` or
  ``(index, ("bad", reason, detail))``, sent in chunks ``(answers, done, stale)`` at least every
  :data:`FLUSH_S` and at the end (``done``; ``stale`` when the process has grown past half its memory
  budget for good and should be replaced). Before each record it writes the record's index and start
  time to the shared ``progress`` slot, so the parent knows which one is in hand without a message.

Each render runs under the process's watchdog (:mod:`dfp_shared.chat_template.budget`: time and
memory between bytecodes, with a precise reason). What no in-process check can stop is the parent's:
it kills this process when an answer is late (one C-level call that never returns), and the address
space limit set here (``RLIMIT_AS``: the process's size once started plus the memory budget) makes one
huge allocation fail at once (``MemoryError``) instead of growing the worker's node. A process whose
parent is gone exits, even in the middle of a render.
"""

from __future__ import annotations

import mmap
import os
import pickle
import resource
import signal
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection

from dfp_shared.chat_template.budget import BudgetExceeded, run_within, watchdog
from jinja2 import TemplateError

from .records import TEMPLATE_BUDGET, TEMPLATE_ERROR, SampleError, short_detail
from .template_spans import TemplateLocator, _compile

PROGRESS = struct.Struct("=qd")
"""Shared with the parent: the index of the record in hand (-1: none) and when it started (monotonic)."""
HEADROOM = 64 * 2**20
"""Address space allowed above the process's size once started and the memory budget (caches, arenas)."""
ORPHAN_POLL_S = 0.5
FLUSH_S = 0.05
"""Answers are sent in chunks, at most this long after the first of them is ready..."""
CHUNK_CHARS = 2**22
"""... or once their texts hold this many characters."""


def _vm_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _exit_when_orphaned(parent: int) -> None:
    while True:
        time.sleep(ORPHAN_POLL_S)
        if os.getppid() != parent:
            os._exit(0)


def _memory_detail(memory_bytes: int) -> str:
    return f"chat template went over its memory budget of {memory_bytes / 2**20:g} MiB (one allocation refused)"


class RenderServer:
    """The loop of the render process: locators by key, one answer per request or record."""

    def __init__(self, conn: Connection, progress: mmap.mmap):
        self.conn = conn
        self.progress = progress
        self.locators: dict[str, TemplateLocator] = {}
        self.baseline = 0

    def send(self, value) -> None:
        self.conn.send_bytes(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def build(self, key: str, args: dict, seconds: float, memory_bytes: int) -> tuple:
        if key in self.locators:
            return ("built",)
        try:
            self.locators[key] = run_within(lambda: TemplateLocator(**args), seconds=seconds,
                                            memory_bytes=memory_bytes)
        except TemplateError as exc:
            return ("refused", "compile", short_detail(str(exc)))
        except BudgetExceeded as exc:
            return ("refused", "budget", str(exc))
        except MemoryError:
            return ("refused", "budget", _memory_detail(memory_bytes)[len("chat template "):])
        except Exception as exc:  # noqa: BLE001 - e.g. no template at all: the parent raises it as a ValueError
            return ("refused", "error", str(exc) or type(exc).__name__)
        return ("built",)

    def render_one(self, locator: TemplateLocator, messages: list, tools, seconds: float, memory_bytes: int) -> tuple:
        try:
            text, turns = run_within(locator.locate, messages, tools, seconds=seconds, memory_bytes=memory_bytes)
        except BudgetExceeded as exc:
            return ("bad", TEMPLATE_BUDGET, f"chat template {exc}")
        except SampleError as exc:
            return ("bad", exc.reason, exc.detail)
        except MemoryError:
            return ("bad", TEMPLATE_BUDGET, _memory_detail(memory_bytes))
        except RecursionError:
            return ("bad", TEMPLATE_ERROR, "chat template failed: RecursionError")
        except Exception as exc:  # noqa: BLE001 - one record's failure, whatever it is, is one bad line
            return ("bad", TEMPLATE_ERROR, f"{type(exc).__name__} while rendering the record")
        return ("ok", text, [(t.message_index, t.gen_start, t.gen_end, t.reasoning, t.content) for t in turns])

    def serve(self) -> None:
        while True:
            try:
                request = pickle.loads(self.conn.recv_bytes())
            except EOFError:
                return
            if request[0] == "build":
                _, key, args, seconds, memory_bytes = request
                self.send(self.build(key, args, seconds, memory_bytes))
            elif request[0] == "render":
                _, key, items, seconds, memory_bytes = request
                self.render(self.locators[key], items, seconds, memory_bytes)

    def render(self, locator: TemplateLocator, items: list, seconds: float, memory_bytes: int) -> None:
        chunk: list[tuple] = []
        chars, flushed = 0, time.monotonic()
        for index, messages, tools in items:
            PROGRESS.pack_into(self.progress, 0, index, time.monotonic())
            answer = self.render_one(locator, messages, tools, seconds, memory_bytes)
            PROGRESS.pack_into(self.progress, 0, -1, 0.0)
            chunk.append((index, answer))
            chars += len(answer[1]) + len(answer[2])
            if chars >= CHUNK_CHARS or time.monotonic() - flushed >= FLUSH_S:
                self.send((chunk, False, False))
                chunk, chars, flushed = [], 0, time.monotonic()
        del items
        # grown past half its budget for good (caches, fragmentation): the parent starts a fresh one
        self.send((chunk, True, _vm_bytes() > self.baseline + HEADROOM + memory_bytes // 2))


def main(argv: list[str] | None = None) -> None:
    fd, memory_bytes, progress_fd = (int(a) for a in (argv or sys.argv[1:])[:3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when a render stops
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent,), name="orphan-guard", daemon=True).start()
    server = RenderServer(Connection(fd), mmap.mmap(progress_fd, PROGRESS.size))
    watchdog()
    _compile("", 1024)  # transformers' environment, imported and built before the size is measured
    server.baseline = _vm_bytes()
    if memory_bytes > 0:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = server.baseline + memory_bytes + HEADROOM
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    server.send(("ready", os.getpid()))
    server.serve()


if __name__ == "__main__":
    main()
