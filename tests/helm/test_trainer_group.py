"""The trainer group: trainer.nodes pods of trainer.gpus GPUs each, rendered, schema-valid and wired."""

from __future__ import annotations

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from tests.support.chart import render_objects, strip_template

KUBE_VERSION = latest_version()


def trainer_objects(nodes: int, mode: str = "colocated") -> dict[tuple[str, str], dict]:
    objects = render_objects({"trainer": {"nodes": nodes, "gpus": 8, "targetMode": mode}}, include_tests=False)
    for obj in objects:
        kubernetes_validate.validate(strip_template(obj), KUBE_VERSION, strict=True)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects
            if o["metadata"]["name"].startswith("dflash-trainer")}


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_one_node_stays_a_deployment_of_independent_trainers():
    objs = trainer_objects(1)
    assert set(objs) == {("Deployment", "dflash-trainer")}
    env = env_of(objs[("Deployment", "dflash-trainer")]["spec"]["template"]["spec"]["containers"][0])
    assert "DFLASH_NODES" not in env and "DFLASH_RDZV_ENDPOINT" not in env


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_four_nodes_render_one_group_with_gpus_per_pod(mode):
    objs = trainer_objects(4, mode)
    assert set(objs) == {("StatefulSet", "dflash-trainer"), ("Service", "dflash-trainer-group")}
    sts, svc = objs[("StatefulSet", "dflash-trainer")], objs[("Service", "dflash-trainer-group")]
    assert sts["spec"]["replicas"] == 4 and sts["spec"]["serviceName"] == "dflash-trainer-group"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    # headless, and it selects the group's pods
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    pod = sts["spec"]["template"]["spec"]
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    env = env_of(trainer)
    assert env["DFLASH_NODES"] == "4" and env["DFLASH_NPROC_PER_NODE"] == "8"
    assert env["DFLASH_RDZV_ENDPOINT"] == "dflash-trainer-0.dflash-trainer-group:29400"
    assert env["DFLASH_NODE_RANK"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert env["DFLASH_GROUP_NAME"] == "dflash-trainer"
    assert {"name": "rdzv", "containerPort": 29400, "protocol": "TCP"} in trainer["ports"]
    # GPU requests are per pod: 8 training GPUs each, plus the colocated sidecar's own
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 8
    sidecars = [c for c in pod["containers"] if c["name"] == "target"]
    if mode == "colocated":  # each pod's own target serves its own ranks over the pod's /dev/shm
        assert len(sidecars) == 1 and sidecars[0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env["DFLASH_TARGET_URL"].startswith(("127.0.0.1", "localhost"))
    else:  # every member's ranks dial the target Service, which spreads them over its pods
        assert not sidecars and "dflash-target" in env["DFLASH_TARGET_URL"]


def test_group_values_are_schema_checked():
    with pytest.raises(Exception, match="nodes"):
        render_objects({"trainer": {"nodes": 0}})
