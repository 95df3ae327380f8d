"""One call that never returns, or allocates gigabytes at once, cannot hold a worker: records render
in a render process that the worker kills.

The sandbox exposes no such call any more (every filter, test and global is sized, linear or Python),
so these tests add two to it (:mod:`.blocking_sandbox`: ``c_sleep``, a C-level sleep that no
asynchronous exception interrupts, and ``c_alloc``, one C-level allocation), both in this process and
in the render processes the worker starts.
"""

from __future__ import annotations

import json
import pickle
import resource
import threading
import time

import pytest
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.specs.tokenize import TokenizeSpec
from dfp_tokenizer.encoder import SampleEncoder
from dfp_tokenizer.files import tokenize_file
from dfp_tokenizer.limits import EncodeLimits

from . import blocking_sandbox
from .conftest import LLAMA_STYLE_TEMPLATE
from .corpus import records
from .test_template_budget import file_task_pending, hang_record, wait_for, worker_for, write_input

SLEEP_ON_MARK = "{%- if 'HANG' in messages[0]['content'] %}{{ c_sleep(40) }}{%- endif %}" + LLAMA_STYLE_TEMPLATE
ALLOC_ON_MARK = "{%- if 'HANG' in messages[0]['content'] %}{{ c_alloc(1.5 * 2**30) }}{%- endif %}" + LLAMA_STYLE_TEMPLATE


@pytest.fixture
def blocking_calls(monkeypatch):
    blocking_sandbox.install(monkeypatch)  # where records rendered before the render process
    try:
        from dfp_tokenizer import render_process
    except ImportError:
        yield
        return
    render_process.POOL.close()  # idle render processes without the blocking calls
    monkeypatch.setattr(render_process, "CHILD_MODULE", "tests.tokenizer.blocking_sandbox")
    yield
    render_process.POOL.close()


def encoder(tokenizer, template: str, limits: EncodeLimits) -> SampleEncoder:
    return SampleEncoder(tokenizer, TokenizeSpec(input="/in", output="/out", tokenizer="/tok", chat_template=template),
                         limits)


def jsonl(recs: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in recs).encode()


@pytest.mark.timeout(180)
def test_a_call_that_never_returns_is_a_counted_bad_line_within_seconds(blocking_calls, llama_style_tokenizer):
    enc = encoder(llama_style_tokenizer, SLEEP_ON_MARK, EncodeLimits(template_timeout_s=1.0))
    good = records(5, seed=21)
    data = jsonl(good[:3] + [hang_record(0)] + good[3:] + [hang_record(1)])
    t0 = time.monotonic()
    res = tokenize_file(data, "file:///in/h.jsonl", "s", enc, id_prefix="h")
    elapsed = time.monotonic() - t0
    assert [(e["line"], e["reason"], e["id"]) for e in res.errors] == [(4, "template_budget", "hang0"),
                                                                      (7, "template_budget", "hang1")]
    assert "time budget of 1 s" in res.errors[0]["detail"] and "killed" in res.errors[0]["detail"]
    assert res.stats.samples == 5 and res.stats.lines == 7
    # each: the budget, the grace, a fresh render process (well under a second when the machine is idle)
    assert elapsed < 2 * (1.0 + 1.0) + 8, elapsed
    # the records after a kill render as before
    clean = tokenize_file(jsonl(good), "file:///in/g.jsonl", "s", enc, id_prefix="g")
    assert clean.stats.samples == 5 and clean.stats.tokens == res.stats.tokens


@pytest.mark.timeout(180)
def test_one_huge_allocation_fails_in_the_render_process_not_the_worker(blocking_calls, llama_style_tokenizer):
    enc = encoder(llama_style_tokenizer, ALLOC_ON_MARK,
                  EncodeLimits(template_timeout_s=30, template_memory_bytes=256 * 2**20))
    good = records(3, seed=22)
    data = jsonl([good[0], hang_record(0), good[1], good[2]])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    res = tokenize_file(data, "file:///in/m.jsonl", "s", enc, id_prefix="m")
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert time.monotonic() - t0 < 20
    assert [(e["line"], e["reason"]) for e in res.errors] == [(2, "template_budget")]
    assert "memory budget of 256 MiB" in res.errors[0]["detail"]
    assert res.stats.samples == 3
    assert growth_mb < 200, growth_mb  # the 1.5 GiB string was never built in this process


@pytest.mark.timeout(180)
def test_cancel_kills_a_render_stuck_in_one_call_within_seconds(blocking_calls, redis_client, tmp_path,
                                                                llama_style_tokenizer_dir):
    inp = write_input(tmp_path, [hang_record(0)] + records(2, seed=23))
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(llama_style_tokenizer_dir),
                                                  "chat_template": SLEEP_ON_MARK})
    # a budget far beyond the test: only the cancel can end this render
    worker = worker_for(redis_client, EncodeLimits(template_timeout_s=3600), lease_ms=1500)
    thread = threading.Thread(target=worker.run, kwargs={"idle_exit_s": 1.0}, daemon=True)
    thread.start()
    wait_for(lambda: file_task_pending(redis_client), 60, "the file task to be claimed")
    time.sleep(1.5)  # inside the sleep now
    JobStore(redis_client).cancel(job.id)
    t0 = time.monotonic()
    wait_for(lambda: file_task_pending(redis_client) is None, 10, "the cancelled task to be given up")
    thread.join(15)
    assert not thread.is_alive() and time.monotonic() - t0 < 15
    assert JobStore(redis_client).get(job.id).state.value == "cancelled"

    from dfp_tokenizer import render_process

    # the render process that was sleeping is gone; only idle ones are left
    assert all(c.proc.poll() is None for c in render_process.POOL.children())
    assert len(render_process.POOL.children()) <= 1


def test_answers_of_the_render_process_are_plain_values_only():
    from dfp_tokenizer.render_process import _plain_loads

    assert _plain_loads(pickle.dumps(("ok", "text", [(1, 2, 3, None, (4, 5))]))) == ("ok", "text", [(1, 2, 3, None, (4, 5))])
    with pytest.raises(pickle.UnpicklingError, match="only plain values"):
        _plain_loads(pickle.dumps(("ok", threading.Event)))
