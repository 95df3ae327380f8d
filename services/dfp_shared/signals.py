"""SIGTERM and SIGINT: installing the stop handlers, counting repeated signals, restoring the old handlers."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Handlers for the stop signals: each signal sets ``stop``, adds one to ``count`` and then calls
    ``on_signal(count, signum)`` (count 2 is the second signal). As a context manager the handlers
    are installed on entry and the previous ones restored on exit; :meth:`install` alone keeps them.
    Python runs handlers in the main thread only, so install from there."""

    def __init__(self, on_signal: Callable[[int, int], None] | None = None, *,
                 signals: tuple[int, ...] = STOP_SIGNALS):
        self.on_signal = on_signal
        self.signals = signals
        self.count = 0
        self.stop = threading.Event()
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def ignore(self) -> None:
        """Ignore the signals from now on, also while the interpreter shuts down (it puts Python
        handlers back to the default action then, so a late signal would kill the process)."""
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum, _frame) -> None:
        self.count += 1
        self.stop.set()
        if self.on_signal is not None:
            self.on_signal(self.count, signum)

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *_exc) -> None:
        self.restore()


def raise_keyboard_interrupt(_count: int, _signum: int) -> None:
    """An ``on_signal`` that makes the signal stop the program the way Ctrl-C does."""
    raise KeyboardInterrupt


def ignore_sigint() -> None:
    """Ignore Ctrl-C in this process (a parent that forwards it as SIGTERM stops it instead)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
