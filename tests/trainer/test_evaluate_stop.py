"""A running evaluation stops within about one decoding step, wherever it is: through a real trainer worker
process, a cancel mid-decode ends the job cancelled and the worker takes its next task at once; a SIGTERM (a
rollout) gives the task back (not failed) and the worker exits well inside the chart's grace period. Each
evaluation decodes a batch of prompts for thousands of tokens: minutes of work before the next batch."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_shared.storage.store import open_store
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.model import DFlashDrafter
from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id
from dfp_trainer.export.zlab import export_drafter

from tests.trainer.train_support import cli, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
LONG = 3000  # new tokens per prompt: a batch of four decodes for minutes on a CPU
STOP_WITHIN_S = 30  # a generous bound for one step, the cancel flag's half-second read and the next task


def _grace_period_s() -> int:
    values = yaml.safe_load((ROOT / "helm" / "dflash-pipeline" / "values.yaml").read_text())
    return int(values["trainer"]["terminationGracePeriodSeconds"])


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_qwen3_dir):
    """A drafter for the tiny target, written by the project's exporter."""
    tok = load_tokenizer(tiny_qwen3_dir)
    parts = load_target_parts(tiny_qwen3_dir)
    cfg = DrafterConfig.for_target(parts.config, num_layers=1, block_size=6, mask_token_id=mask_token_id(tok))
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(cfg, parts.embed_tokens, parts.lm_head), tmp_path_factory.mktemp("drafter"))


def _evaluate(redis_client, tmp_path, drafter_dir, target_dir, name: str, prompts: int, max_new_tokens: int) -> str:
    source = tmp_path / f"{name}.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"Count to {i + 3}: one two"}) + "\n" for i in range(prompts)))
    job, _ = queue_job(redis_client, "evaluate", {
        "drafter": f"file://{drafter_dir}", "target": f"file://{target_dir}", "prompts": [f"file://{source}"],
        "output": f"file://{tmp_path}/{name}", "max_new_tokens": max_new_tokens, "max_prompts": prompts,
        "batch_size": prompts, "enable_thinking": False})
    return job.id


def _start_worker(redis_server, tmp_path, *args: str) -> subprocess.Popen:
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 - the child writes it (a pipe could fill and block it)
    try:
        return subprocess.Popen(cli("trainer", "worker", "--redis-url", redis_server.url, *args),
                                env=subprocess_env(DFLASH_LEASE_MS=3000), stdout=subprocess.DEVNULL, stderr=log)
    finally:
        log.close()


def _until(what, proc: subprocess.Popen, tmp_path, timeout: float, message: str):
    """Poll ``what()`` until it is truthy; fail with ``message`` (and the worker's log) at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError(f"{message}\n{(tmp_path / 'worker.log').read_text()[-3000:]}")
        time.sleep(0.1)


def _decoding(jobs: JobStore, job_id: str, proc, tmp_path) -> None:
    """Wait until the evaluation decodes (its prompt total is set just before), then a little more."""
    _until(lambda: jobs.get(job_id).totals.get("prompts"), proc, tmp_path, 300,  # torch's import is slow here
           "the evaluation never started decoding")
    time.sleep(1.0)
    assert jobs.get(job_id).counters.get("prompts", 0) == 0  # inside the first batch


def _reap(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def test_a_cancel_mid_decode_ends_the_evaluation_and_the_worker_takes_the_next_task(
        redis_server, redis_client, tmp_path, tiny_qwen3_dir, drafter_dir):
    long = _evaluate(redis_client, tmp_path, drafter_dir, tiny_qwen3_dir, "long", 4, LONG)
    jobs = JobStore(redis_client)
    proc = _start_worker(redis_server, tmp_path, "--max-tasks", "2", "--idle-exit", "5")
    try:
        _decoding(jobs, long, proc, tmp_path)
        jobs.cancel(long)
        short = _evaluate(redis_client, tmp_path, drafter_dir, tiny_qwen3_dir, "short", 1, 4)
        _until(lambda: jobs.get(short).state == JobState.succeeded, proc, tmp_path, STOP_WITHIN_S,
               f"the worker was still decoding the cancelled evaluation {STOP_WITHIN_S} s after the cancel")
        assert _reap(proc, 60) == 0
    finally:
        proc.kill()
    assert jobs.get(long).state == JobState.cancelled
    assert not open_store(f"file://{tmp_path}/long").exists("evaluation.json")  # no report of a stopped run
    assert open_store(f"file://{tmp_path}/short").exists("evaluation.json")
    queue = TaskQueue(redis_client, "train")
    assert queue.pending() == 0 and queue.dead_letters() == []


def test_a_sigterm_mid_decode_gives_the_evaluation_back_within_the_grace_period(
        redis_server, redis_client, tmp_path, tiny_qwen3_dir, drafter_dir):
    grace = _grace_period_s()
    job_id = _evaluate(redis_client, tmp_path, drafter_dir, tiny_qwen3_dir, "long", 4, LONG)
    jobs = JobStore(redis_client)
    proc = _start_worker(redis_server, tmp_path)
    try:
        _decoding(jobs, job_id, proc, tmp_path)
        proc.send_signal(signal.SIGTERM)  # a rollout: the pod has its grace period, then SIGKILL
        signalled = time.monotonic()
        code = _reap(proc, min(STOP_WITHIN_S, grace))
        exited_after = time.monotonic() - signalled
    finally:
        proc.kill()
    assert code == 0 and exited_after < min(STOP_WITHIN_S, grace)
    assert jobs.get(job_id).state == JobState.running  # not failed: another worker takes it
    assert not open_store(f"file://{tmp_path}/long").exists("evaluation.json")
    queue = TaskQueue(redis_client, "train")
    assert queue.pending() == 1 and queue.dead_letters() == []
    (entry_id,) = [e for e, _ in redis_client.xrange(queue.stream)]
    assert redis_client.hget(queue.released_key, entry_id) == "1"  # given back, not a death
