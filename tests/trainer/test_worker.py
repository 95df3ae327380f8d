"""The train worker: a train job from Redis runs to completion with progress, outputs in S3; bad input fails fast."""

from __future__ import annotations

import json
import logging
import subprocess

import pytest
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.worker import Worker
from dfp_shared.storage.store import open_store
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler

from tests.trainer.data_support import write_dataset
from tests.trainer.train_support import cli, subprocess_env, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_worker_completes_a_train_job_and_reports_progress(redis_server, redis_client, s3_server, s3_bucket,
                                                           tiny_qwen3_dir, tiny_dataset, target_server, caplog):
    """Hidden states come from the gRPC target service; outputs go to S3."""
    caplog.set_level(logging.INFO, logger="dfp_trainer")
    output = f"{s3_bucket}/runs/r1"
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, output, steps=5, checkpoint_every=2, eval_prompts=2,
                     eval_max_new_tokens=6, target_endpoint="grpc")
    job, _ = queue_job(redis_client, "train", spec)
    settings = TrainerSettings(redis_url=redis_server.url, s3_endpoint_url=s3_server.endpoint_url, device="cpu",
                               progress_every_s=0.001, target_endpoints=json.dumps({"grpc": f"127.0.0.1:{target_server.port}"}))
    jobs = JobStore(redis_client)
    worker = Worker(TaskQueue(redis_client, "train", lease_ms=settings.lease_ms), jobs,
                    TrainHandler(settings, redis_client), heartbeat_s=0.5)
    assert worker.run(max_tasks=1, idle_exit_s=5) == 1

    rec = jobs.get(job.id)
    assert rec.state == JobState.succeeded, rec.error
    assert rec.counters["steps"] == 5 and rec.totals["steps"] == 5
    for key in ("loss", "tokens_per_s", "data_wait_fraction", "lr", "accuracy"):
        assert key in rec.counters, key
    assert 0 <= rec.counters["data_wait_fraction"] <= 1
    progress = rec.progress()
    assert "steps" in json.dumps(progress)
    events = [e for _, kind, e in jobs.events(job.id) if kind == "progress"]
    assert [e["step"] for e in events] == [1, 2, 3, 4, 5]
    assert events[-1]["loss"] < events[0]["loss"]

    out = open_store(output, endpoint_url=s3_server.endpoint_url)
    assert rec.outputs["drafter"] == output + "/drafter/"
    assert rec.outputs["report"] == output + "/report.json"
    assert rec.outputs["checkpoints"] == output + "/checkpoints/"
    config = json.loads(out.get("drafter/config.json"))
    assert config["architectures"] == ["DFlashDraftModel"]
    report = json.loads(out.get("report.json"))
    ev = report["evaluation"]
    assert ev["eval_prompts"] == 2 and ev["tau_trained"] >= 1.0 and ev["tau_untrained"] >= 1.0
    assert ev["tau_ngram"] >= 1.0 and len(ev["eval_ngram"]["per_prompt"]) == 2  # the baseline on the same prompts
    assert rec.outputs["tau_ngram"] == ev["tau_ngram"]
    assert len(report["summary"]["per_position_accuracy"]) == spec["block_size"] - 1
    assert len(rec.outputs["per_position_accuracy"]) == spec["block_size"] - 1 and rec.outputs["final_loss"] > 0
    held = ev["heldout_trained"]  # objective metrics on the held-out samples, trained and untrained drafter
    assert ev["heldout_samples"] == 2 and held["loss"] > 0 and ev["heldout_untrained"]["loss"] > 0
    assert len(held["per_position_accuracy"]) == spec["block_size"] - 1
    assert rec.outputs["heldout_loss"] == held["loss"] and rec.outputs["heldout_accuracy"] == held["accuracy"]
    assert rec.outputs["heldout_per_position_accuracy"] == [round(a, 4) for a in held["per_position_accuracy"]]
    (finished,) = [r for r in caplog.records if r.getMessage() == "training finished"]
    assert finished.per_position_accuracy == rec.outputs["per_position_accuracy"]
    assert finished.tau_trained == ev["tau_trained"] and finished.tau_untrained == ev["tau_untrained"]
    assert finished.heldout_per_position_accuracy == rec.outputs["heldout_per_position_accuracy"]
    for png in ("loss_curve.png", "position_accuracy.png"):
        assert out.get(png)[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = json.loads(out.get("checkpoints/latest.json"))
    assert ckpt["step"] == 5
    assert [k for k in out.list("checkpoints/") if k.endswith("model.safetensors")] == [
        "checkpoints/step-00000004/model.safetensors", "checkpoints/step-00000005/model.safetensors"]


@pytest.mark.parametrize("nproc", [1, 2], ids=["in-process", "torchrun"])
def test_worker_fails_a_job_with_a_foreign_dataset_at_once(tmp_path, redis_server, redis_client, tiny_qwen3_dir,
                                                           tiny_samples, nproc):
    foreign = write_dataset(f"file://{tmp_path}/foreign", *tiny_samples, tiny_qwen3_dir,
                            fingerprint="0000111122223333")
    job, _ = queue_job(redis_client, "train", tiny_spec(foreign, tiny_qwen3_dir, f"file://{tmp_path}/out"))
    done = subprocess.run(cli("trainer", "worker", "--max-tasks", "1", "--idle-exit", "10",
                              "--redis-url", redis_server.url),
                          env=subprocess_env(DFLASH_NPROC_PER_NODE=nproc), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.failed
    assert "tokenizer_fingerprint is '0000111122223333'" in rec.error and "another tokenizer" in rec.error
    assert TaskQueue(redis_client, "train").dead_letters() == []  # bad input is not retried
    assert list(open_store(f"file://{tmp_path}/out").list("")) == [".dflash-owner.json"]  # claimed; no step ran


@pytest.mark.parametrize("nproc", [1, 2], ids=["in-process", "torchrun"])
def test_worker_fails_a_job_whose_target_has_only_pickled_weights_at_once(tmp_path, redis_server, redis_client,
                                                                          tiny_qwen3_dir, tiny_dataset, nproc):
    """A target whose weights are only a pickle (``pytorch_model.bin``) is refused, and the job fails at once with
    the reason: never retried, on one process or under torchrun."""
    import shutil

    target = tmp_path / "pickled-target"
    shutil.copytree(tiny_qwen3_dir, target, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    (target / "pytorch_model.bin").write_bytes(b"never unpickled")
    job, _ = queue_job(redis_client, "train", tiny_spec(tiny_dataset, target, f"file://{tmp_path}/out"))
    done = subprocess.run(cli("trainer", "worker", "--max-tasks", "1", "--idle-exit", "10",
                              "--redis-url", redis_server.url),
                          env=subprocess_env(DFLASH_NPROC_PER_NODE=nproc), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.failed and "safetensors" in rec.error, rec.error
    assert TaskQueue(redis_client, "train").dead_letters() == []  # failed at once, not after retries


def test_a_killed_worker_s_job_resumes_on_another_worker(tmp_path, redis_server, redis_client, tiny_qwen3_dir,
                                                         tiny_dataset):
    """SIGKILL the worker mid-run: the task's lease expires, the next worker reclaims it and resumes."""
    output = f"file://{tmp_path}/out"
    job, _ = queue_job(redis_client, "train", tiny_spec(tiny_dataset, tiny_qwen3_dir, output, steps=8,
                                                        checkpoint_every=2))
    env = subprocess_env(DFLASH_LEASE_MS=2000)
    proc = subprocess.Popen(cli("trainer", "worker", "--redis-url", redis_server.url), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if '"checkpoint saved"' in line:
                proc.kill()
                break
    finally:
        proc.kill()
        proc.wait(timeout=30)
    ckpts = open_store(output + "/checkpoints")
    killed_at = json.loads(ckpts.get("latest.json"))["step"]
    assert 2 <= killed_at < 8
    jobs = JobStore(redis_client)
    assert jobs.get(job.id).state == JobState.running

    settings = TrainerSettings(redis_url=redis_server.url, device="cpu", lease_ms=2000, progress_every_s=0.001)
    worker = Worker(TaskQueue(redis_client, "train", lease_ms=2000), jobs, TrainHandler(settings, redis_client),
                    heartbeat_s=0.5)
    assert worker.run(max_tasks=1, idle_exit_s=15) == 1
    rec = jobs.get(job.id)
    assert rec.state == JobState.succeeded, rec.error
    assert rec.counters["steps"] == 8
    steps = [e["step"] for _, kind, e in jobs.events(job.id) if kind == "progress"]
    assert steps[-(8 - killed_at):] == list(range(killed_at + 1, 9))  # continued after the checkpoint
    assert json.loads(ckpts.get("latest.json"))["step"] == 8


def test_torchrun_children_serve_the_trainer_gauges(tmp_path, redis_server, redis_client, tiny_qwen3_dir,
                                                    tiny_dataset):
    """With two processes per pod the ranks are torchrun children; the worker's /metrics still shows the
    node's training gauges, which its local rank 0 set (prometheus_client's multiprocess mode)."""
    import time

    import httpx
    from dfp_dev.local.redis_server import free_port

    job, _ = queue_job(redis_client, "train", tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out",
                                                        steps=4))
    port = free_port()
    proc = subprocess.Popen(cli("trainer", "worker", "--redis-url", redis_server.url),
                            env=subprocess_env(DFLASH_NPROC_PER_NODE=2, DFLASH_METRICS_PORT=port),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        jobs = JobStore(redis_client)
        deadline = time.monotonic() + 300
        while jobs.get(job.id).state not in (JobState.succeeded, JobState.failed) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert jobs.get(job.id).state == JobState.succeeded, jobs.get(job.id).error
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("dfp_trainer_")}
    assert values["dfp_trainer_step"] == 4, text
    assert values["dfp_trainer_tokens_per_second"] > 0 and 0 <= values["dfp_trainer_data_wait_fraction"] <= 1
    assert "dfp_trainer_comm_fraction" in values
