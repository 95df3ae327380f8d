"""One bad record never fails a tokenize job: deep nesting, lone surrogates, over-long lines, a
record that breaks a whole tokenizer batch; bad lines are counted without quoting their content."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap

from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.jobs.worker import Worker
from dfp_shared.records.token_shards import load_dataset
from dfp_shared.specs.tokenize import TokenizeSpec
from dfp_tokenizer.encoder import SampleEncoder
from dfp_tokenizer.files import shard_name, tokenize_file
from dfp_tokenizer.limits import EncodeLimits
from dfp_tokenizer.tasks import EncoderCache, TokenizeHandler

from tests.support.cli import ROOT, cli_env

from .corpus import records

SECRET = "SECRETPAYLOAD"
DEEP = '{"id": "deep", "messages": ' + "[" * 1000 + "]" * 1000 + "}"
SURROGATE = json.dumps({"id": "surrogate", "messages": [{"role": "user", "content": "x"},
                                                        {"role": "assistant", "content": "ok"}]}).replace(
    '"x"', '"text with a lone \\ud800 surrogate"')
LONG_PART = json.dumps({"id": "part", "messages": [{"role": "user", "content": [{"type": "image", "url": SECRET * 50}]},
                                                   {"role": "assistant", "content": "x"}]})
LONG_ROLE = json.dumps({"id": "role", "messages": [{"role": SECRET * 500, "content": "x"},
                                                   {"role": "assistant", "content": "y"}]})
LONG_LINE = json.dumps({"id": "long", "messages": [{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": SECRET * 2000}]})


def run_until_idle(r, encoders: EncoderCache | None = None, max_deliveries: int = 3) -> Worker:
    queue = TaskQueue(r, TOKENIZE.stream, lease_ms=5000, max_deliveries=max_deliveries)
    worker = Worker(queue, JobStore(r), TokenizeHandler(r, encoders or EncoderCache()), block_ms=100)
    worker.run(idle_exit_s=1.0)
    return worker


def test_records_that_break_parsing_or_tokenizing_are_counted_and_the_job_succeeds(redis_client, tmp_path,
                                                                                   qwen3_tokenizer_dir):
    good = records(12, seed=5)
    bad = [DEEP, SURROGATE, LONG_PART, LONG_ROLE, LONG_LINE]
    lines = [json.dumps(good[0])] + bad[:2] + [json.dumps(r) for r in good[1:6]] + bad[2:] + \
            [json.dumps(r) for r in good[6:]]
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    # the surrogate shares a tokenizer batch with good samples: only it may be lost
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(out),
                                                  "tokenizer": str(qwen3_tokenizer_dir), "samples_per_batch": 64})
    run_until_idle(redis_client, EncoderCache(limits=EncodeLimits(max_line_bytes=16384)), max_deliveries=1)

    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "succeeded", rec.error
    assert rec.counters["samples"] == len(good) and rec.counters["bad_lines"] == len(bad)
    raw = (out / "errors" / f"{shard_name('mixed.jsonl')}.jsonl").read_text()
    errors = {e["line"]: e for e in map(json.loads, raw.splitlines())}
    at = {lines.index(b) + 1: b for b in bad}
    assert set(errors) == set(at)
    reason = {b: errors[n]["reason"] for n, b in at.items()}
    assert reason[DEEP] == "malformed_json" and "nested" in errors[lines.index(DEEP) + 1]["detail"]
    assert reason[SURROGATE] == "invalid_unicode" and "U+D800" in errors[lines.index(SURROGATE) + 1]["detail"]
    assert reason[LONG_PART] == "bad_message" and reason[LONG_ROLE] == "unknown_role"
    assert reason[LONG_LINE] == "line_too_long"
    assert all(e["file"].endswith("/in/mixed.jsonl") and e["detail"] for e in errors.values())
    # no bad line is quoted at length: an excerpt of 16 characters at most
    assert SECRET[3:] + SECRET[:4] not in raw and raw.count(SECRET) <= 1
    assert max(len(x) for x in raw.splitlines()) < 400
    ds = load_dataset(str(out))
    assert sorted(ds.sample_ids) == sorted(r["id"] for r in good)


def test_a_failing_batch_falls_back_to_one_record_at_a_time(qwen3_tokenizer):
    good = records(40, seed=9)
    lines = [json.dumps(r) for r in good[:20]] + [SURROGATE] + [json.dumps(r) for r in good[20:]]
    enc = SampleEncoder(qwen3_tokenizer, TokenizeSpec(input="/in", output="/out", tokenizer="/tok"))
    res = tokenize_file(("\n".join(lines)).encode(), "file:///in/x.jsonl", "shards/x.safetensors", enc, id_prefix="x")
    assert res.stats.samples == 40 and dict(res.stats.errors) == {"invalid_unicode": 1}
    assert res.errors[0]["line"] == 21 and res.errors[0]["id"] == "surrogate"
    one = tokenize_file(json.dumps(good[0]).encode(), "file:///in/y.jsonl", "shards/y.safetensors", enc, id_prefix="y")
    assert one.stats.tokens > 0


MEASURE = textwrap.dedent("""
    import gzip, json, resource, sys
    from dfp_shared.specs.tokenize import TokenizeSpec
    from dfp_shared.models.tokenizer_assets import load_tokenizer
    from dfp_tokenizer.encoder import SampleEncoder
    from dfp_tokenizer.files import tokenize_file
    from dfp_tokenizer.limits import EncodeLimits

    tok_dir, path = sys.argv[1], sys.argv[2]
    enc = SampleEncoder(load_tokenizer(tok_dir), TokenizeSpec(input="/in", output="/out", tokenizer="/tok",
                                                              max_length=4096), limits=EncodeLimits())
    data = open(path, "rb").read()
    tokenize_file(data[:data.index(b"\\n") + 1], "file:///w.jsonl", "w", enc, id_prefix="w")  # warm-up
    out = {}
    for name, blob in (("plain", data), ("gzip", gzip.compress(data, 1))):
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        res = tokenize_file(blob, "file:///in/big.jsonl" + (".gz" if name == "gzip" else ""), "s", enc, id_prefix="b")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out[name] = {"growth_mb": (peak - base) / 1024, "samples": res.stats.samples, "errors": dict(res.stats.errors)}
        del res
    print(json.dumps(out))
""")


def test_a_50_mb_line_is_rejected_before_parsing_with_bounded_memory(tmp_path, qwen3_tokenizer_dir):
    good = records(3, seed=2)
    big = json.dumps({"id": "big", "messages": [{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "word " * 10_000_000}]})
    assert len(big) > 50_000_000
    path = tmp_path / "big.jsonl"
    path.write_bytes(("\n".join([json.dumps(good[0]), big, json.dumps(good[1]), json.dumps(good[2])]) + "\n").encode())
    del big
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(qwen3_tokenizer_dir), str(path)], env=cli_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("plain", "gzip"):
        assert got[name]["samples"] == 3 and got[name]["errors"] == {"line_too_long": 1}, got
        # parsing and tokenizing the line takes gigabytes; rejecting it unread takes (almost) nothing
        assert got[name]["growth_mb"] < 120, got


def test_line_limit_counts_every_line_and_keeps_line_numbers(qwen3_tokenizer):
    good = [json.dumps(r) for r in records(3, seed=4)]
    limit = max(len(g.encode()) for g in good)  # a line of exactly the limit is kept
    lines = [good[0], "x" * (limit + 1), "", good[1], "y" * 3 * limit, good[2]]
    data = ("\n".join(lines)).encode()
    enc = SampleEncoder(qwen3_tokenizer, TokenizeSpec(input="/in", output="/out", tokenizer="/tok"),
                        limits=EncodeLimits(max_line_bytes=limit))
    for blob, uri in ((data, "file:///in/a.jsonl"), (gzip.compress(data), "file:///in/a.jsonl.gz")):
        res = tokenize_file(blob, uri, "s", enc, id_prefix="a")
        assert res.stats.samples == 3 and res.stats.lines == 6  # every line, the blank one included
        assert [(e["line"], e["reason"]) for e in res.errors] == [(2, "line_too_long"), (3, "blank_line"),
                                                                  (5, "line_too_long")]
        assert str(limit) in res.errors[0]["detail"]
