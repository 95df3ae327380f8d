"""``dflash-pipeline tokenizer run``: submit, run the pool, show progress, print the result."""

from __future__ import annotations

import json
import subprocess

import pytest
from dfp_shared.records.token_shards import load_dataset

from tests.support.cli import cli_cmd, cli_env

from .corpus import jsonl, records


def test_tokenizer_run_command(redis_server, tmp_path, qwen3_tokenizer_dir):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(jsonl(records(20, seed=5)) + b"{broken\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        cli_cmd("tokenizer", "run", "--input", str(tmp_path / "in"), "--output", str(out), "--tokenizer",
                str(qwen3_tokenizer_dir), "--processes", "1", "--no-thinking", "--train-turns", "last",
                "--log-level", "WARNING"),
        env=cli_env(DFLASH_REDIS_URL=redis_server.url), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "tokenize files" in proc.stdout and "1/1" in proc.stdout
    result = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert result["state"] == "succeeded" and result["counters"]["bad_lines"] == 1
    # tokens/s count the tokenization only; the start-up before it is shown apart
    timing = result["timing"]
    assert timing["startup_s"] > 0 and timing["tokenize_s"] > 0
    assert timing["tokens_per_s"] == pytest.approx(result["counters"]["tokens"] / timing["tokenize_s"], rel=0.03)
    ds = load_dataset(result["outputs"]["dataset"])
    assert ds.num_samples == 20


def test_tokenizer_run_rejects_a_bad_option(redis_server, tmp_path):
    proc = subprocess.run(cli_cmd("tokenizer", "run", "--input", str(tmp_path), "--output", str(tmp_path / "o"),
                                  "--tokenizer", str(tmp_path), "--max-length", "2"),
                          env=cli_env(DFLASH_REDIS_URL=redis_server.url), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "max_length" in proc.stderr
