"""A pool run in a caller's process (``run_job``: the tokenizer's command, the benchmarks) gives the stop signals
back when it returns: Ctrl-C and SIGTERM stop the caller again afterwards instead of reaching a finished pool."""

from __future__ import annotations

import os
import signal
import time

import pytest
from dfp_tokenizer.pool import Pool, run_process
from dfp_tokenizer.settings import TokenizerSettings


@pytest.fixture
def callers_handlers():
    """The caller's own SIGTERM and SIGINT handlers (recording what they receive), the originals restored after:
    whatever an earlier test in this process left installed is not what this test checks against."""
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)

    originals = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield handler, received
    for sig, original in originals.items():
        signal.signal(sig, original)


def test_a_finished_pool_leaves_the_callers_signal_handlers(redis_server, redis_client, tmp_path, callers_handlers):
    handler, received = callers_handlers
    settings = TokenizerSettings(redis_url=redis_server.url, storage_url=f"file://{tmp_path}", processes="1")
    Pool(settings, 1, idle_exit_s=0.2).run()  # no task queued: the process exits once idle
    assert signal.getsignal(signal.SIGTERM) is handler and signal.getsignal(signal.SIGINT) is handler
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(os.getpid(), sig)
    deadline = time.monotonic() + 10
    while len(received) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the handler runs in the main thread at its next instruction
    assert received == [signal.SIGINT, signal.SIGTERM]


def test_a_process_run_in_the_callers_main_thread_gives_its_handlers_back(redis_server, redis_client, tmp_path,
                                                                           callers_handlers):
    handler, _ = callers_handlers
    settings = TokenizerSettings(redis_url=redis_server.url, storage_url=f"file://{tmp_path}", threads=1)
    assert run_process(settings, idle_exit_s=0.2) == 0
    assert signal.getsignal(signal.SIGTERM) is handler and signal.getsignal(signal.SIGINT) is handler
