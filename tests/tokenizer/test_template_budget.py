"""Chat templates cannot hang a worker: a runaway render is a counted bad line, a template that runs
away on every conversation fails its job clearly, cancel and a second SIGTERM stop a render in hand."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest
from dfp_shared.jobs.queue import GROUP, TaskQueue, stream_name
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.jobs.worker import Worker
from dfp_tokenizer.limits import EncodeLimits
from dfp_tokenizer.tasks import EncoderCache, TokenizeHandler

from tests.support.cli import cli_cmd, cli_env

from .conftest import LLAMA_STYLE_TEMPLATE
from .corpus import records

SPIN = "{%- for i in range(100000) %}{%- for j in range(100000) %}{%- endfor %}{%- endfor %}"
# spins on a conversation whose first message says HANG; the probe conversations render normally
HANG_ON_MARK = "{%- if 'HANG' in messages[0]['content'] %}" + SPIN + "{%- endif %}" + LLAMA_STYLE_TEMPLATE
HANG_ALWAYS = SPIN + LLAMA_STYLE_TEMPLATE


def hang_record(i: int) -> dict:
    return {"id": f"hang{i}", "messages": [{"role": "user", "content": "HANG please"},
                                           {"role": "assistant", "content": "never rendered"}]}


def write_input(tmp_path, recs: list[dict]):
    inp = tmp_path / "in"
    inp.mkdir(exist_ok=True)
    (inp / "f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return inp


def worker_for(r, limits: EncodeLimits, lease_ms: int = 3000) -> Worker:
    queue = TaskQueue(r, TOKENIZE.stream, lease_ms=lease_ms, max_deliveries=3)
    return Worker(queue, JobStore(r), TokenizeHandler(r, EncoderCache(limits=limits)), block_ms=100)


@pytest.mark.timeout(120)
def test_runaway_render_is_a_counted_bad_line(redis_client, tmp_path, llama_style_tokenizer_dir):
    recs = records(6, seed=3)
    inp = write_input(tmp_path, recs[:3] + [hang_record(0)] + recs[3:] + [hang_record(1)])
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(llama_style_tokenizer_dir),
                                                  "chat_template": HANG_ON_MARK})
    t0 = time.monotonic()
    worker_for(redis_client, EncodeLimits(template_timeout_s=0.5)).run(idle_exit_s=1.0)
    assert time.monotonic() - t0 < 60
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "succeeded", rec.error
    assert rec.counters["samples"] == 6 and rec.counters["bad_lines"] == 2
    errors = [json.loads(x) for x in next((tmp_path / "out" / "errors").iterdir()).read_text().splitlines()]
    assert [(e["line"], e["reason"], e["id"]) for e in errors] == [(4, "template_budget", "hang0"),
                                                                   (8, "template_budget", "hang1")]
    assert "0.5 s" in errors[0]["detail"]


@pytest.mark.timeout(120)
def test_a_template_that_always_runs_away_fails_the_job_clearly(redis_client, tmp_path, llama_style_tokenizer_dir):
    inp = write_input(tmp_path, records(3, seed=1))
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(llama_style_tokenizer_dir),
                                                  "chat_template": HANG_ALWAYS})
    t0 = time.monotonic()
    worker_for(redis_client, EncodeLimits(template_timeout_s=0.5)).run(idle_exit_s=1.0)
    assert time.monotonic() - t0 < 60
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "failed"
    assert "chat_template" in rec.error and "budget" in rec.error, rec.error
    assert TaskQueue(redis_client, TOKENIZE.stream).dead_letters() == []  # failed at once, not after retries


def file_task_pending(r) -> dict | None:
    for row in r.xpending_range(stream_name(TOKENIZE.stream), GROUP, "-", "+", 50):
        fields = r.xrange(stream_name(TOKENIZE.stream), row["message_id"], row["message_id"])
        if fields and fields[0][1].get("key", "").endswith(".jsonl"):
            return row
    return None


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(120)
def test_cancel_stops_a_render_in_hand_within_seconds(redis_client, tmp_path, llama_style_tokenizer_dir):
    inp = write_input(tmp_path, [hang_record(0)] + records(2, seed=2))
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(llama_style_tokenizer_dir),
                                                  "chat_template": HANG_ON_MARK})
    # a budget far beyond the test: only the cancel can end this render
    worker = worker_for(redis_client, EncodeLimits(template_timeout_s=3600), lease_ms=1500)
    thread = threading.Thread(target=worker.run, kwargs={"idle_exit_s": 1.0}, daemon=True)  # as in the pool
    thread.start()
    wait_for(lambda: file_task_pending(redis_client), 60, "the file task to be claimed")
    time.sleep(1.0)  # well inside the render now
    JobStore(redis_client).cancel(job.id)
    t0 = time.monotonic()
    wait_for(lambda: file_task_pending(redis_client) is None, 10, "the cancelled task to be given up")
    thread.join(15)
    assert not thread.is_alive() and time.monotonic() - t0 < 20
    assert JobStore(redis_client).get(job.id).state.value == "cancelled"


@pytest.mark.timeout(180)
def test_second_sigterm_stops_a_worker_rendering_a_runaway_template(redis_server, redis_client, tmp_path,
                                                                   llama_style_tokenizer_dir):
    inp = write_input(tmp_path, [hang_record(0)])
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(tmp_path / "out"),
                                                  "tokenizer": str(llama_style_tokenizer_dir),
                                                  "chat_template": HANG_ON_MARK})
    env = cli_env(DFLASH_REDIS_URL=redis_server.url, DFLASH_LEASE_MS="60000", DFLASH_TEMPLATE_TIMEOUT_S="3600",
                  DFLASH_LOG_LEVEL="WARNING", DFLASH_CACHE_DIR=str(tmp_path / "cache"))
    log = open(tmp_path / "worker.log", "wb")
    proc = subprocess.Popen(cli_cmd("tokenizer", "worker", "--processes", "1", "--threads", "2"), env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: file_task_pending(redis_client), 90, "the file task to be claimed")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(15)
        assert time.monotonic() - t0 < 10, (tmp_path / "worker.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    row = file_task_pending(redis_client)
    assert row is not None and row["time_since_delivered"] >= 60000  # given back: reclaimable at once
    assert JobStore(redis_client).get(job.id).state.value == "running"


def test_registered_templates_by_name_and_inline_templates_refused(tmp_path, llama_style_tokenizer, qwen3_tokenizer):
    from dfp_shared.specs.tokenize import TokenizeSpec
    from dfp_tokenizer.encoder import SampleEncoder
    from dfp_tokenizer.limits import TemplateUnavailable
    from dfp_tokenizer.records import parse_line

    (tmp_path / "llama3.jinja").write_text(LLAMA_STYLE_TEMPLATE)
    limits = EncodeLimits(chat_templates_dir=str(tmp_path), allow_inline_templates=False)
    spec = dict(input="/in", output="/out", tokenizer="/tok")
    named = SampleEncoder(llama_style_tokenizer, TokenizeSpec(**spec, chat_template="llama3"), limits)
    inline = SampleEncoder(llama_style_tokenizer, TokenizeSpec(**spec, chat_template=LLAMA_STYLE_TEMPLATE))
    sample = parse_line(json.dumps(records(1, seed=8)[0]), "x:1")
    assert named.prepare(sample).text == inline.prepare(sample).text
    assert named.chat_template_fingerprint == inline.chat_template_fingerprint
    with pytest.raises(TemplateUnavailable, match="no registered template named 'chatml'.*registered: llama3"):
        SampleEncoder(llama_style_tokenizer, TokenizeSpec(**spec, chat_template="chatml"), limits)
    with pytest.raises(TemplateUnavailable, match="only registered template names"):
        SampleEncoder(llama_style_tokenizer, TokenizeSpec(**spec, chat_template=LLAMA_STYLE_TEMPLATE), limits)
    # the tokenizer's own template needs no registration (it still renders under the budget)
    assert SampleEncoder(qwen3_tokenizer, TokenizeSpec(**spec), limits).prepare(sample).text


def test_a_template_that_grows_memory_is_stopped_by_the_memory_budget(qwen3_tokenizer):
    from dfp_shared.specs.tokenize import TokenizeSpec
    from dfp_tokenizer.encoder import SampleEncoder
    from dfp_tokenizer.files import tokenize_file

    grow = ("{%- if 'HANG' in messages[0]['content'] %}{%- set ns = namespace(s='x') %}"
            "{%- for i in range(60) %}{%- set ns.s = ns.s ~ ns.s %}{%- endfor %}{%- endif %}" + LLAMA_STYLE_TEMPLATE)
    enc = SampleEncoder(qwen3_tokenizer, TokenizeSpec(input="/in", output="/out", tokenizer="/tok", chat_template=grow),
                        EncodeLimits(template_timeout_s=60, template_memory_bytes=64 * 2**20))
    data = "".join(json.dumps(r) + "\n" for r in [hang_record(0)] + records(2, seed=6)).encode()
    t0 = time.monotonic()
    res = tokenize_file(data, "file:///in/m.jsonl", "s", enc, id_prefix="m")
    assert time.monotonic() - t0 < 30
    assert res.stats.samples == 2 and [e["reason"] for e in res.errors] == ["template_budget"]
    assert "memory budget of 64 MiB" in res.errors[0]["detail"]
