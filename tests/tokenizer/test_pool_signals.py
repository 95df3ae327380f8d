"""A pool run in a caller's process (``run_job``: the tokenizer's command, the benchmarks) gives the stop signals
back when it returns: Ctrl-C and SIGTERM stop the caller again afterwards instead of reaching a finished pool."""

from __future__ import annotations

import os
import signal
import time

import pytest
from dfp_tokenizer.pool import Pool, run_process
from dfp_tokenizer.settings import TokenizerSettings


def test_a_finished_pool_leaves_the_callers_signal_handlers(redis_server, redis_client, tmp_path):
    settings = TokenizerSettings(redis_url=redis_server.url, storage_url=f"file://{tmp_path}", processes="1")
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    Pool(settings, 1, idle_exit_s=0.2).run()  # no task queued: the process exits once idle
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs in the main thread at its next instruction


def test_a_process_run_in_the_callers_main_thread_gives_its_handlers_back(redis_server, redis_client, tmp_path):
    settings = TokenizerSettings(redis_url=redis_server.url, storage_url=f"file://{tmp_path}", threads=1)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    assert run_process(settings, idle_exit_s=0.2) == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before
