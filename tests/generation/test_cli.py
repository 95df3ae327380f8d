"""The ``dflash-pipeline generation`` commands as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "services") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **(env or {})}
    return subprocess.run([sys.executable, "-m", "dfp_cli.main", "generation", *args], env=full_env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=timeout)


def test_run_writes_shards_and_a_rerun_skips_them(tmp_path, openai_server):
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(5)] + ["oops"])
    args = ["run", "--prompts", str(tmp_path / "p.jsonl"), "--output", str(tmp_path / "out"), "--engine", "openai",
            "--openai-base-url", openai_server.base_url, "--openai-model", "m", "--shard-size", "2",
            "--samples-per-prompt", "2", "--no-thinking", "--log-level", "WARNING"]
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    totals = json.loads(proc.stdout.strip().splitlines()[-1])
    assert totals["prompts"] == 5 and totals["completions"] == 10 and totals["unreadable"] == 1
    assert totals["shards"] == 3 and totals["outputs"]["completions"].endswith("/out/completions/")
    records = [r for f in sorted((tmp_path / "out" / "completions").iterdir()) for r in read_jsonl(f)]
    assert sorted(r["id"] for r in records) == sorted(f"p.jsonl:{i + 1}#{k}" for i in range(5) for k in range(2))
    assert all("reasoning_content" not in r["messages"][-1] for r in records)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["completions"] == 10
    served = openai_server.status_counts[200]
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert openai_server.status_counts[200] == served
    # a different shard size: new shard names, and the old files do not linger beside them
    at = args.index("--shard-size") + 1
    bigger = cli(*args[:at], "4", *args[at + 1:])
    assert bigger.returncode == 0, bigger.stderr
    files = sorted(p.name for p in (tmp_path / "out" / "completions").iterdir())
    assert files == ["shard-00000.jsonl", "shard-00001.jsonl"]
    records = [r for f in sorted((tmp_path / "out" / "completions").iterdir()) for r in read_jsonl(f)]
    assert len(records) == 10 and len({r["id"] for r in records}) == 10


def test_bad_settings_and_specs_are_named():
    proc = cli("worker", env={"DFLASH_GENERATION_BATCH_SIZE": "0"})
    assert proc.returncode == 2 and "DFLASH_GENERATION_BATCH_SIZE" in proc.stderr
    proc = cli("run", "--prompts", "/tmp/p.jsonl", "--output", "/tmp/o", "--temperature", "-1")
    assert proc.returncode == 2 and "temperature" in proc.stderr
