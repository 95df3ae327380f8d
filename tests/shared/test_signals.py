"""The stop-signal handlers: counting, callbacks, restoring the previous handlers."""

from __future__ import annotations

import os
import signal

import pytest
from dfp_shared.signals import StopSignals, ignore_sigint, raise_keyboard_interrupt


def test_counts_signals_calls_back_and_restores():
    seen = []
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignals(lambda count, signum: seen.append((count, signum))) as signals:
        assert not signals.stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.stop.is_set() and signals.count == 1
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.count == 2
    assert seen == [(1, signal.SIGTERM), (2, signal.SIGINT)]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_only_the_named_signals_and_keyboard_interrupt():
    before = signal.getsignal(signal.SIGINT)
    with StopSignals(raise_keyboard_interrupt, signals=(signal.SIGTERM,)):
        assert signal.getsignal(signal.SIGINT) is before
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)


def test_ignore_sigint():
    before = signal.getsignal(signal.SIGINT)
    try:
        ignore_sigint()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)  # ignored
    finally:
        signal.signal(signal.SIGINT, before)


def test_ignore_after_installing():
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals().install()
    try:
        signals.ignore()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.count == 0
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) is before
