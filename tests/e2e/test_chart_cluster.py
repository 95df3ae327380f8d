"""End to end on the chart's own wiring: the rendered workloads run as local processes.

The Helm chart is rendered with real Helm; each Deployment and StatefulSet runs as local
processes with its rendered command, args and environment (Services mapped to loopback ports,
S3 through moto's server in its own process, Redis from the chart's own StatefulSet and
redis.conf). A pipeline job goes through the API while faults are injected in the same run:
the API is killed and restarted, a tokenizer worker is SIGKILLed mid-job, the target service
is killed and restarted mid-training, and the trainer is SIGKILLed mid-training. The pipeline
must still finish with every prompt once in the completions, every completion once in the
token dataset, and training resumed from its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from dfp_dev.local.redis_server import free_port, wait_for_port
from dfp_shared.jobs.queue import GROUP, stream_name
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.records.token_shards import load_dataset
from dfp_shared.storage.store import open_store
from redis import Redis, ResponseError

from tests.support.chart import render_objects
from tests.support.cli import ROOT, cli_env
from tests.support.local_cluster import LocalCluster

PROMPTS = 16
CREDS = {"AWS_ACCESS_KEY_ID": "e2e", "AWS_SECRET_ACCESS_KEY": "e2e-secret"}


@pytest.fixture
def s3_endpoint(monkeypatch):
    for name, value in CREDS.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.s3_server_proc", "--port", str(port)],
                            cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, timeout=60)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait()


def chart_values(endpoint: str) -> dict:
    """A CPU-only install: one API pod, two tokenizer pods, the target as its own Deployment."""
    return {
        "gpu": {"enabled": False},
        "storage": {"url": "s3://e2e/data", "allowedPrefixes": ["s3://e2e/models"],
                    "s3": {"endpointUrl": endpoint, "existingSecret": "s3-creds"}},
        "api": {"replicas": 1},
        "tokenizer": {"replicas": 2, "processes": 1, "env": {"DFLASH_LEASE_MS": "3000"}},
        "generation": {"replicas": 1},
        "target": {"model": "s3://e2e/models/target"},
        "trainer": {"gpus": 1, "targetMode": "disaggregated", "env": {"DFLASH_LEASE_MS": "4000"}},
    }


def put_inputs(endpoint: str, target_dir, prompts: int) -> None:
    """The inputs of :func:`pipeline_spec` on the S3 API: the target checkpoint and a prompt set."""
    store = open_store("s3://e2e", endpoint_url=endpoint)
    store.ensure_bucket()
    store.put_many((f"models/target/{p.name}", p.read_bytes()) for p in Path(target_dir).iterdir() if p.is_file())
    lines = [json.dumps({"id": f"p{i:03d}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]})
             for i in range(prompts)]
    store.put("data/prompts/set.jsonl", ("\n".join(lines) + "\n").encode())


def pipeline_spec() -> dict:
    model = "s3://e2e/models/target"
    return {"type": "pipeline", "spec": {
        "generate": {"prompts": "s3://e2e/data/prompts/", "output": "s3://e2e/data/generate", "model": model,
                     "temperature": 0.0, "max_new_tokens": 32, "shard_size": 2, "thinking": True},
        "tokenize": {"output": "s3://e2e/data/tokens", "tokenizer": model, "max_length": 512},
        "train": {"target": model, "output": "s3://e2e/data/train", "steps": 40, "checkpoint_every": 10,
                  "tokens_per_batch": 256, "max_length": 128, "num_draft_layers": 1, "block_size": 4,
                  "max_anchors": 4, "lr": 5e-3, "eval_prompts": 2, "eval_max_new_tokens": 8},
    }}


class Api:
    """The test's HTTP client: tolerates the API being down while it restarts."""

    def __init__(self, url: str, key: str):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=10)

    def get(self, path: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                resp = self.http.get(path)
                if resp.status_code < 500:
                    resp.raise_for_status()
                    return resp.json()
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"GET {path}: API unavailable")
            time.sleep(0.3)

    def stage(self, pipeline_id: str, stage: str) -> dict | None:
        job_id = self.get(f"/v1/jobs/{pipeline_id}")["outputs"].get(f"{stage}_job")
        return self.get(f"/v1/jobs/{job_id}") if job_id else None


def wait_for(pred, what: str, cluster: LocalCluster, timeout: float = 300, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    logs = "\n".join(f"--- {n}\n{p.log_tail(15)}" for n, p in cluster.group.procs.items())
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def wait_finished(api: Api, job_id: str, cluster: LocalCluster, timeout: float = 500, every: float = 0.3) -> dict:
    """The job's record once it is succeeded, failed or cancelled."""
    return wait_for(lambda: (lambda j: j if j["state"] in ("succeeded", "failed", "cancelled") else None)(
        api.get(f"/v1/jobs/{job_id}")), f"job {job_id} to finish", cluster, timeout=timeout, every=every)


def completion_records(data) -> list[dict]:
    """Every completion record the generate stage wrote under ``generate/completions/`` of the store ``data``."""
    return [json.loads(line) for key in data.list("generate/completions/")
            for line in data.get(key).decode().splitlines() if line.strip()]


def freeze_holding_a_task(redis: Redis, pgid: int, cluster: LocalCluster, timeout: float = 400) -> str:
    """Stop (SIGSTOP) the process group ``pgid`` at a moment one of its consumers holds a tokenize
    task, so a kill that follows provably lands mid-task. Returns the held task's stream id."""
    stream = stream_name(TOKENIZE.stream)

    def held() -> str | None:
        try:
            rows = redis.xpending_range(stream, GROUP, min="-", max="+", count=100)
        except ResponseError:  # NOGROUP: no tokenize task was queued yet
            return None
        for row in rows:
            consumer_pid = int(row["consumer"].rsplit("-", 2)[1])  # "<host>-<pid>-<thread>"
            try:
                if os.getpgid(consumer_pid) == pgid:
                    return row["message_id"]
            except ProcessLookupError:
                continue
        return None

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if held():
            os.killpg(pgid, signal.SIGSTOP)
            task = held()  # frozen: what it holds now, it holds when killed
            if task:
                return task
            os.killpg(pgid, signal.SIGCONT)
        time.sleep(0.005)
    logs = "\n".join(f"--- {n}\n{p.log_tail(15)}" for n, p in cluster.group.procs.items())
    raise AssertionError(f"no tokenize task was ever held by process group {pgid}\n{logs}")


def test_pipeline_on_the_charts_processes_survives_faults(tmp_path, s3_endpoint, tiny_qwen3_dir):
    put_inputs(s3_endpoint, tiny_qwen3_dir, PROMPTS)

    cluster = LocalCluster(render_objects(chart_values(s3_endpoint)), tmp_path / "cluster", secrets={"s3-creds": CREDS},
                           base_env=cli_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"))
    try:
        cluster.start("dflash-redis")
        for name in ("dflash-api", "dflash-target", "dflash-generation", "dflash-trainer"):
            cluster.start(name)
        cluster.start("dflash-tokenizer", replicas=1)
        key = cluster.secrets["dflash-api-keys"]["admin-key"]
        api = Api(cluster.service_url("dflash-api", 80), key)
        wait_for(lambda: api.get("/readyz"), "the API", cluster, timeout=120)

        job = api.http.post("/v1/jobs", json=pipeline_spec(), headers={"Idempotency-Key": "e2e-1"}).json()
        pid = job["id"]

        # fault: the API restarts; a retried submit returns the same job
        cluster.restart("dflash-api")
        wait_for(lambda: api.get("/readyz"), "the API after its restart", cluster, timeout=120)
        resubmit = api.http.post("/v1/jobs", json=pipeline_spec(), headers={"Idempotency-Key": "e2e-1"}).json()
        assert resubmit["id"] == pid

        # `kubectl scale deployment/dflash-tokenizer --replicas=2`: a second process of the same rendered spec
        assert len(cluster.scale("dflash-tokenizer", 2)) == 2

        # fault: a tokenizer worker is SIGKILLed with a task in hand; its Deployment replaces it and
        # the task is reclaimed by a consumer once its lease runs out
        redis = Redis(port=cluster.service_ports[("dflash-redis", 6379)], decode_responses=True)
        held = freeze_holding_a_task(redis, cluster.process("dflash-tokenizer", 0).pid, cluster)
        cluster.kill("dflash-tokenizer", 0)
        cluster.restart("dflash-tokenizer", 0)

        # fault: the target service dies and comes back mid-training
        def train_steps() -> float:
            train = api.stage(pid, "train")
            return train["counters"].get("steps", 0) if train else 0

        wait_for(lambda: train_steps() >= 5, "training to start", cluster, timeout=400)
        cluster.kill("dflash-target")
        time.sleep(1.0)
        cluster.restart("dflash-target")

        # fault: the trainer dies after a checkpoint; the task is reclaimed and training resumes
        wait_for(lambda: train_steps() >= 13, "training past its first checkpoint", cluster, timeout=400)
        cluster.kill("dflash-trainer")
        cluster.restart("dflash-trainer")

        final = wait_finished(api, pid, cluster, timeout=500)
        assert final["state"] == "succeeded", final
        stages = {s: api.stage(pid, s) for s in ("generate", "tokenize", "train")}
    finally:
        cluster.stop()

    # every prompt exactly once in the completions
    data = open_store("s3://e2e/data", endpoint_url=s3_endpoint)
    records = completion_records(data)
    assert sorted(r["id"] for r in records) == sorted(f"p{i:03d}" for i in range(PROMPTS))

    # the killed worker's task was reclaimed by another consumer
    reclaims = [json.loads(line) for n, proc in cluster.group.procs.items() if n.startswith("dflash-tokenizer")
                for line in proc.log_path.read_text().splitlines() if "reclaimed task" in line]
    assert held in [r.get("task") for r in reclaims], reclaims

    # every completion exactly once in the token dataset
    dataset = load_dataset("s3://e2e/data/tokens", endpoint_url=s3_endpoint)
    assert sorted(dataset.sample_ids) == sorted(r["id"] for r in records)
    assert stages["tokenize"]["counters"]["samples"] == PROMPTS

    # training resumed from a checkpoint and finished every step, with an export and an evaluation
    trainer_log = cluster.process("dflash-trainer").log_path.read_text()
    resumed = [json.loads(line) for line in trainer_log.splitlines() if '"msg": "resumed"' in line]
    assert resumed and resumed[-1]["step"] >= 10
    train = stages["train"]
    assert train["counters"]["steps"] == 40
    assert data.exists("train/drafter/config.json") and data.exists("train/drafter/model.safetensors")
    assert train["outputs"]["tau_trained"] is not None
