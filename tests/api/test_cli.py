"""The real server command (`dflash-pipeline api serve`, uvicorn) and the job client commands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import free_port, wait_for_port

from .conftest import API_TEST_STORAGE, READ_KEY, WRITE_KEY, key_entries
from .tokenize_worker import start_worker, write_completions

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


@pytest.fixture
def server(redis_server, redis_client):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dfp_cli.main", "api", "serve", "--port", str(port),
                             "--host", "127.0.0.1", "--redis-url", redis_server.url],
                            env=_env(DFLASH_API_KEYS=key_entries(), DFLASH_SSE_POLL_S="0.2",
                                     DFLASH_ALLOWED_PREFIXES=f"{API_TEST_STORAGE},"
                                                             f"{os.environ.get('DFLASH_ALLOWED_PREFIXES', '')}"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_port(port, timeout=60)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def cli(url: str, key: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfp_cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(DFLASH_API_URL=url, DFLASH_API_KEY=key))


def test_client_commands_against_the_server(server, redis_client, encoders, qwen3_tokenizer_dir, tmp_path):
    url, proc = server
    spec_file = tmp_path / "gen.yaml"
    spec_file.write_text("prompts: s3://bucket/prompts/\noutput: s3://bucket/out\n")
    made = cli(url, WRITE_KEY, "submit", "generate", "-f", str(spec_file), "--model", "/models/tiny",
               "--set", "temperature=0.0", "--json")
    assert made.returncode == 0, made.stderr
    job = json.loads(made.stdout)
    assert job["state"] == "queued" and job["spec"]["temperature"] == 0.0 and job["spec"]["model"] == "/models/tiny"

    listed = cli(url, WRITE_KEY, "jobs", "--json", "--type", "generate")
    assert [j["id"] for j in json.loads(listed.stdout)["items"]] == [job["id"]]
    assert json.loads(cli(url, READ_KEY, "jobs", "--json").stdout)["items"] == []  # another key's job
    shown = cli(url, WRITE_KEY, "status", job["id"])
    assert shown.returncode == 0 and job["id"] in shown.stdout and "queued" in shown.stdout
    hidden = cli(url, READ_KEY, "status", job["id"])
    assert hidden.returncode == 1 and "404" in hidden.stderr

    denied = cli(url, READ_KEY, "cancel", job["id"])
    assert denied.returncode == 1 and "403" in denied.stderr
    assert "cancelled" in cli(url, WRITE_KEY, "cancel", job["id"]).stdout
    again = cli(url, WRITE_KEY, "cancel", job["id"])
    assert again.returncode == 1 and "409" in again.stderr
    watched = cli(url, WRITE_KEY, "status", job["id"], "--watch")
    assert watched.returncode == 1 and "cancelled" in watched.stdout

    bad = cli(url, WRITE_KEY, "submit", "tokenize", "--input", "s3://b/../x", "--output", "ftp://h/x",
              "--tokenizer", "/t")
    assert bad.returncode == 1
    assert "spec.input: 's3://b/../x'" in bad.stderr
    assert "spec.output: 'ftp://h/x': URI scheme 'ftp' is not allowed" in bad.stderr
    assert cli(url, "wrong-key", "jobs").stderr.count("401") == 1

    # a job run to completion by a real worker, watched live by the client
    completions = write_completions(tmp_path / "completions", files=3, per_file=2)
    worker, thread = start_worker(redis_client, encoders)
    try:
        done = cli(url, WRITE_KEY, "submit", "tokenize", "--input", completions, "--output",
                   (tmp_path / "tokens").as_uri(), "--tokenizer", str(qwen3_tokenizer_dir), "--watch")
    finally:
        worker.stopping.set()
        thread.join(10)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "succeeded" in done.stdout and "output dataset" in done.stdout and "queued -> running" in done.stdout
    assert (tmp_path / "tokens" / "manifest.json").exists()

    proc.send_signal(signal.SIGTERM)
    logs = proc.communicate(timeout=15)[0]
    assert WRITE_KEY not in logs and READ_KEY not in logs
    assert '"msg": "job submitted"' in logs
