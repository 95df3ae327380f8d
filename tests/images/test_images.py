"""Every service from its built image, run as the chart runs it.

The chart is rendered with real Helm (CPU-only install, the target as its own Deployment) and its
workloads run as in the chart-driven local cluster, except that the project's containers run from
the image under podman: the pod's user and group, a read-only root filesystem, capabilities
dropped, no privilege escalation, the chart's environment only, its emptyDir and Secret volumes
bind-mounted at their mount paths, host networking (Services on loopback ports). Redis is the
chart's own StatefulSet run by a local redis-server on a free port, S3 is moto's server: both
outside the containers. Each service is started alone and waited for by its own readiness probe
(start-up seconds are printed); then the target answers gRPC health and a hidden-state request
that matches the same model run here, and a pipeline job submitted to the API is generated,
tokenized and trained to its exported drafter by the containers. A container started with a
missing or bad setting exits non-zero naming the setting.

``make images-check`` builds the image and runs this module with ``DFLASH_TEST_IMAGE`` set to it;
without podman, or without that variable, the module is skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.test_chart_cluster import (
    Api,
    chart_values,
    completion_records,
    pipeline_spec,
    put_inputs,
    wait_finished,
    wait_for,
)
from tests.support.chart import render_objects
from tests.support.cli import cli_env
from tests.support.local_cluster import Containers, LocalCluster

PODMAN = shutil.which("podman")
IMAGE = os.environ.get("DFLASH_TEST_IMAGE", "")
pytestmark = [
    pytest.mark.skipif(PODMAN is None, reason="podman is not installed (make images-check needs podman, runc and mmdebstrap)"),
    pytest.mark.skipif(not IMAGE, reason="DFLASH_TEST_IMAGE is not set: `make images-check` builds the image and sets it"),
]

CREDS = {"AWS_ACCESS_KEY_ID": "images", "AWS_SECRET_ACCESS_KEY": "images-secret"}
PROMPTS = 6
SERVICES = ("dflash-api", "dflash-target", "dflash-tokenizer", "dflash-generation", "dflash-trainer")


@pytest.fixture(scope="module")
def image():
    found = subprocess.run([PODMAN, "image", "exists", IMAGE], capture_output=True)
    assert found.returncode == 0, f"image {IMAGE} is not built (make images)"
    return IMAGE


def project_refs(objects: list[dict]) -> set[str]:
    """The image references of the project's containers (those that run ``dflash-pipeline``)."""
    return {c["image"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")
            for c in o["spec"]["template"]["spec"]["containers"] if c.get("command", [None])[0] == "dflash-pipeline"}


def make_cluster(tmp_path: Path, endpoint: str, image: str) -> LocalCluster:
    values = chart_values(endpoint)
    values["tokenizer"]["replicas"] = 1
    objects = render_objects(values)
    return LocalCluster(objects, tmp_path / "cluster", secrets={"s3-creds": CREDS}, base_env=cli_env(),
                        containers=Containers({ref: image for ref in project_refs(objects)}))


def probe_ok(cluster: LocalCluster, workload: str) -> bool:
    """The workload's first container passes its rendered readiness probe (httpGet or grpc)."""
    pod = cluster.pods[workload][0]
    container = cluster.workloads[workload]["spec"]["template"]["spec"]["containers"][0]
    probe = container["readinessProbe"]
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    if "grpc" in probe:
        port = pod.ports[probe["grpc"]["port"]]
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
    get = probe["httpGet"]
    port = pod.ports[named.get(get["port"], get["port"])]
    try:
        return httpx.get(f"http://127.0.0.1:{port}{get['path']}", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def in_container(name: str, code: str) -> dict:
    """Run Python in a running container (as its user) and return the JSON it prints."""
    out = subprocess.run([PODMAN, "exec", name, "python", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


AS_THE_CHART_RUNS_IT = """
import json, os
def writable(path):
    try:
        with open(os.path.join(path, ".probe"), "w"):
            pass
        os.remove(os.path.join(path, ".probe"))
        return True
    except OSError:
        return False
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
                  "writable": {p: writable(p) for p in ("/", "/home/app", "/opt/venv", "/tmp", "/cache", "/dev/shm")}}))
"""


def test_every_service_runs_from_the_image(tmp_path, s3_server, tiny_qwen3_dir, image, capsys):
    import torch
    from dfp_shared.hidden_states import TargetClient, forward_batch
    from dfp_shared.models.loading import load_causal_lm
    from dfp_shared.records.token_shards import load_dataset
    from dfp_shared.storage.store import open_store

    endpoint = s3_server.endpoint_url
    put_inputs(endpoint, tiny_qwen3_dir, PROMPTS)

    cluster = make_cluster(tmp_path, endpoint, image)
    startup = {}
    try:
        cluster.start("dflash-redis")
        for name in SERVICES:  # one at a time: each one's start-up alone on the machine
            began = time.monotonic()
            cluster.start(name)
            wait_for(lambda name=name: probe_ok(cluster, name) or cluster.group.check_alive(), f"{name} ready",
                     cluster, timeout=300, every=0.2)
            startup[name] = time.monotonic() - began
        with capsys.disabled():  # a figure for the reader, not a check
            print("\nstart-up to readiness (s): "
                  + ", ".join(f"{k.removeprefix('dflash-')} {v:.1f}" for k, v in startup.items()))

        # each container as the chart runs it
        for workload in SERVICES:
            for name in cluster.pods[workload][0].containers:
                seen = in_container(name, AS_THE_CHART_RUNS_IT)
                assert (seen["uid"], seen["gid"]) == (10001, 10001) and 10001 in seen["groups"], (name, seen)
                assert seen["writable"] == {"/": False, "/home/app": False, "/opt/venv": False, "/tmp": True,
                                            "/cache": True, "/dev/shm": True}, (name, seen)

        key = cluster.secrets["dflash-api-keys"]["admin-key"]
        api = Api(cluster.service_url("dflash-api", 80), key)
        assert api.get("/healthz") is not None and api.get("/readyz") is not None

        # the target: a hidden-state request answered as the same model answers it here
        address = f"127.0.0.1:{cluster.pods['dflash-target'][0].ports[50051]}"
        sequences = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int32)
                     for n in (7, 19)]
        layers = [0, 1]

        async def ask():
            client = TargetClient(address, retry_deadline_s=30)
            try:
                return client.model_info(), await client.hidden_states(sequences, layers)
            finally:
                await client.close()

        info, served = asyncio.run(ask())
        model = load_causal_lm(str(tiny_qwen3_dir))
        expected = [forward_batch(model, [s], layers)[0] for s in sequences]
        assert info.num_layers == model.config.num_hidden_layers
        for got, want in zip(served, expected, strict=True):
            assert got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-4)

        # a pipeline job through the API: generated, tokenized and trained by the containers
        spec = pipeline_spec()
        spec["spec"]["train"].update(steps=10, checkpoint_every=5)
        job = api.http.post("/v1/jobs", json=spec).json()
        final = wait_finished(api, job["id"], cluster, timeout=900, every=1.0)
        assert final["state"] == "succeeded", final
        stages = {s: api.stage(job["id"], s) for s in ("generate", "tokenize", "train")}
    finally:
        cluster.stop()

    data = open_store("s3://e2e/data", endpoint_url=endpoint)
    records = completion_records(data)
    assert sorted(r["id"] for r in records) == sorted(f"p{i:03d}" for i in range(PROMPTS))
    dataset = load_dataset("s3://e2e/data/tokens", endpoint_url=endpoint)
    assert sorted(dataset.sample_ids) == sorted(r["id"] for r in records)
    assert stages["tokenize"]["counters"]["samples"] == PROMPTS
    assert stages["train"]["counters"]["steps"] == 10
    assert data.exists("train/drafter/config.json") and data.exists("train/drafter/model.safetensors")


@pytest.mark.parametrize(("workload", "env", "drop", "setting"), [
    ("dflash-target", {}, ("DFLASH_MODEL",), "DFLASH_MODEL"),
    ("dflash-api", {"DFLASH_LOG_LEVEL": "LOUD"}, (), "DFLASH_LOG_LEVEL"),
    ("dflash-tokenizer", {"DFLASH_METRICS_PORT": "70000"}, (), "DFLASH_METRICS_PORT"),
    ("dflash-generation", {"DFLASH_GENERATION_BATCH_SIZE": "0"}, (), "DFLASH_GENERATION_BATCH_SIZE"),
    ("dflash-trainer", {"DFLASH_METRICS_PORT": "-1"}, (), "DFLASH_METRICS_PORT"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("dflash-") else None)
def test_a_missing_or_bad_setting_stops_the_container_naming_it(tmp_path, image, workload, env, drop, setting):
    cluster = make_cluster(tmp_path, "http://127.0.0.1:9", image)
    try:
        run = cluster.run_once(workload, extra_env=env, drop_env=drop, timeout=180)
    finally:
        cluster.stop()
    assert run.returncode != 0 and setting in run.stdout + run.stderr, (run.returncode, run.stderr[-2000:])
