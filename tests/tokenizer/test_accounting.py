"""Every input line ends as a sample or a counted reason with file, line and id: blank lines, invalid
UTF-8, duplicate sample ids; a job over an empty file ends cleanly."""

from __future__ import annotations

import json

import pytest
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.records.token_shards import load_dataset
from dfp_tokenizer.files import tokenize_file

from .test_job import run_until_idle
from .test_masking import encoder_for


def line(sid: str, answer: str = "ok") -> bytes:
    return json.dumps({"id": sid, "messages": [{"role": "user", "content": "q"},
                                               {"role": "assistant", "content": answer}]}).encode()


def run_file(tokenizer, data: bytes, **opts):
    res = tokenize_file(data, "file:///in/a.jsonl", "shards/a.safetensors", encoder_for(tokenizer, **opts), id_prefix="a")
    s = res.stats
    assert s.lines == s.samples + sum(s.errors.values())  # every line accounted for
    return res


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_blank_lines_invalid_utf8_and_duplicate_ids_are_each_reported(qwen3_tokenizer, policy):
    data = b"\n".join([line("x"), b"", b"   ", b'{"id": "bad", "messages": "\xff\xfe"}', line("x", "again"), line("y"),
                       "\ufeff".encode() + line("z")]) + b"\n"
    res = run_file(qwen3_tokenizer, data, duplicate_ids=policy)
    by_line = {e["line"]: e for e in res.errors}
    assert res.stats.lines == 7
    assert by_line[2]["reason"] == by_line[3]["reason"] == "blank_line" and by_line[2]["file"] == "file:///in/a.jsonl"
    assert by_line[4]["reason"] == "invalid_utf8" and "0xff" in by_line[4]["detail"]
    assert by_line[5]["reason"] == "duplicate_id" and by_line[5]["id"] == "x"
    assert res.stats.errors["blank_line"] == 2 and res.stats.errors["invalid_utf8"] == 1
    kept = policy == "keep"
    assert by_line[5].get("kept", False) is kept
    assert res.stats.duplicate_ids == int(kept) and res.stats.errors["duplicate_id"] == int(not kept)
    assert res.stats.samples == (4 if kept else 3)  # x, (x), y and z: a byte order mark is not an error


def test_final_newline_starts_no_line(qwen3_tokenizer):
    res = run_file(qwen3_tokenizer, line("a") + b"\n" + line("b") + b"\n")
    assert res.stats.lines == 2 and not res.errors


def test_job_over_an_empty_file_succeeds_with_an_empty_dataset(redis_client, tmp_path, qwen3_tokenizer_dir):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.jsonl").write_bytes(b"")
    out = tmp_path / "out"
    job, _ = queue_job(redis_client, "tokenize", {"input": str(tmp_path / "in"), "output": str(out),
                                                  "tokenizer": str(qwen3_tokenizer_dir)})
    run_until_idle(redis_client)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "succeeded", rec.error
    assert rec.outputs["samples"] == 0 and load_dataset(str(out)).manifest["num_samples"] == 0


def test_job_with_lines_but_no_usable_sample_fails_without_a_manifest(redis_client, tmp_path, qwen3_tokenizer_dir):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "blank.jsonl").write_bytes(b"\n\n{not json}\n")
    out = tmp_path / "out"
    job, _ = queue_job(redis_client, "tokenize", {"input": str(tmp_path / "in"), "output": str(out),
                                                  "tokenizer": str(qwen3_tokenizer_dir)})
    run_until_idle(redis_client)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "failed" and "3 bad lines" in rec.error
    assert json.loads((out / "stats.json").read_text())["errors_by_reason"] == {"blank_line": 2, "malformed_json": 1}
    assert not (out / "manifest.json").exists()
