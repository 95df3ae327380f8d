"""The confined child that parses untrusted files: a memory ceiling, a wall-time budget and a cancel, each
ending the child (never the caller) with the reason; its peak memory is measured."""

from __future__ import annotations

import time

import pytest
from dfp_shared.models.confined import ConfinedError, LimitExceeded, Limits, run_confined

from tests.support.hostile_files import write_endless_array_gguf

HOSTILE = "tests.support.hostile_files"
MB = 1 << 20


def test_a_child_that_allocates_without_end_stops_at_its_ceiling():
    with pytest.raises(LimitExceeded) as stopped:
        run_confined(f"{HOSTILE}:grow_without_end", {}, Limits(memory_bytes=256 * MB, seconds=120))
    assert stopped.value.kind == "memory" and "256 MiB" in stopped.value.message


def test_gguf_s_own_reader_on_the_endless_array_stops_at_the_ceiling(tmp_path):
    """The parsers the import hands a file to believe its counts; in the child they cannot take the worker."""
    path = write_endless_array_gguf(tmp_path / "endless.gguf")
    started = time.monotonic()
    with pytest.raises(LimitExceeded) as stopped:
        run_confined(f"{HOSTILE}:read_with_gguf_reader", {"path": str(path)}, Limits(256 * MB, seconds=60),
                     preload=("gguf",))
    assert stopped.value.kind in ("memory", "time"), stopped.value
    assert time.monotonic() - started < 60 + 15


def test_the_time_budget_and_a_cancel_end_the_child():
    with pytest.raises(LimitExceeded, match="still running after 2 s") as late:
        run_confined(f"{HOSTILE}:sleep_without_end", {}, Limits(256 * MB, seconds=2))
    assert late.value.kind == "time"

    class Cancelled(Exception):
        pass

    calls = []

    def check():
        calls.append(time.monotonic())
        if len(calls) > 4:
            raise Cancelled()

    with pytest.raises(Cancelled):
        run_confined(f"{HOSTILE}:sleep_without_end", {}, Limits(256 * MB, seconds=600), check=check)
    assert len(calls) == 5


def test_answers_and_errors_come_back_as_plain_values(tmp_path):
    done = run_confined("posixpath:basename", {"p": "/x/y"}, Limits(256 * MB, seconds=60))
    assert done.value == "y" and 0 < done.peak_rss_bytes < 256 * MB
    with pytest.raises(ConfinedError) as failed:
        run_confined("json:loads", {"s": "{"}, Limits(256 * MB, seconds=60))
    assert failed.value.kind == "JSONDecodeError"
