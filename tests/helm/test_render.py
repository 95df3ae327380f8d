"""The chart renders and lints clean for every value profile, and every object it renders is valid."""

from __future__ import annotations

import copy

import helm_python
import jsonschema
import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from tests.helm.crd_schemas import REDIS_STREAMS_METADATA, SCALED_OBJECT, SCHEMAS
from tests.helm.profiles import PROFILES
from tests.support.chart import CHART_DIR, strip_template

KUBE_VERSION = latest_version()  # the newest Kubernetes release kubernetes-validate ships schemas for


def test_lint_clean(profile):
    report = helm_python.lint(str(CHART_DIR), PROFILES[profile], strict=True, namespace="dflash",
                              kube_version=f"v{KUBE_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems
    assert report["total_charts_linted"] == 1


def test_objects_validate_strictly(objects):
    checked = 0
    for obj in objects:
        obj = strip_template(obj)
        key = (obj["apiVersion"], obj["kind"])
        if key in SCHEMAS:
            jsonschema.validate(obj, SCHEMAS[key])
        else:
            # strict: unknown fields are errors, as the API server would reject them
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        checked += 1
    assert checked >= 15


def test_names_are_unique_per_kind(objects):
    seen = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(seen) == len(set(seen)), sorted(seen)
    for kind, name in seen:
        assert len(name) <= 63, (kind, name)


def test_every_profile_renders_what_it_enables():
    from tests.helm.conftest import objects_for

    kinds = {p: {(o["kind"], o["metadata"]["name"]) for o in objects_for(p)} for p in PROFILES}
    assert ("StatefulSet", "dflash-redis") in kinds["defaults"]
    assert not any(k == "StatefulSet" for k, _ in kinds["external-redis"])
    assert ("ScaledObject", "dflash-tokenizer") in kinds["gpu-keda"]
    assert ("ScaledObject", "dflash-generation") in kinds["gpu-keda"]
    assert ("Ingress", "dflash-api") in kinds["gpu-keda"]
    assert {("ServiceMonitor", "dflash-api"), ("ServiceMonitor", "dflash-target"),
            ("PodMonitor", "dflash-workers")} <= kinds["gpu-keda"]
    assert not any(k == "ScaledObject" for k, _ in kinds["defaults"])
    assert {("Deployment", "dflash-capture"), ("Service", "dflash-capture"), ("ServiceMonitor", "dflash-capture"),
            ("PodDisruptionBudget", "dflash-capture")} <= kinds["gpu-keda"]
    assert not any(name == "dflash-capture" for p in PROFILES if p != "gpu-keda" for _, name in kinds[p])
    assert ("Deployment", "dflash-target") not in kinds["cpu-small"]
    assert {("CronJob", "dflash-adapt"), ("ConfigMap", "dflash-adapt")} <= kinds["gpu-keda"]
    assert not any(name == "dflash-adapt" for p in PROFILES if p != "gpu-keda" for _, name in kinds[p])
    for p in PROFILES:
        assert ("Pod", "dflash-test-api-readyz") in kinds[p]
        assert ("ServiceAccount", "dflash") in kinds[p]


# the hand-written CRD schemas must themselves reject what KEDA would reject, or they prove nothing

def _scaled_object(**metadata):
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"},
            "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "redis-streams", "metadata": metadata}]}}


@pytest.mark.parametrize("metadata, reason", [
    ({"address": "r:6379", "consumerGroup": "g", "lagCount": "5"}, "lagCount without activationLagCount"),
    ({"address": "r:6379", "stream": "s", "consumerGroup": "g", "lagCount": 5, "activationLagCount": "0"}, "number, not string"),
    ({"stream": "s", "consumerGroup": "g", "lagCount": "5", "activationLagCount": "0"}, "no address"),
    ({"address": "r:6379", "stream": "s", "lagCount": "1", "activationLagCount": "0", "pendingEntries": "3"}, "unknown key"),
    ({"address": "redis://r:6379", "stream": "s", "streamLength": "5"}, "address is host:port, not a URL"),
])
def test_keda_schema_rejects(metadata, reason):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_scaled_object(**metadata), SCALED_OBJECT)


def test_keda_schema_rejects_unknown_spec_field():
    obj = _scaled_object(address="r:6379", stream="s", consumerGroup="g", lagCount="1", activationLagCount="0")
    jsonschema.validate(obj, SCALED_OBJECT)
    jsonschema.validate(obj["spec"]["triggers"][0]["metadata"], REDIS_STREAMS_METADATA)
    bad = copy.deepcopy(obj)
    bad["spec"]["minReplicas"] = 1  # KEDA's field is minReplicaCount
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCALED_OBJECT)


def test_kubernetes_validate_is_strict():
    """The validator really rejects an unknown field and a wrong type (else the test above proves nothing)."""
    from tests.helm.conftest import objects_for

    deploy = strip_template(next(o for o in objects_for("defaults") if o["kind"] == "Deployment"))
    typo = copy.deepcopy(deploy)
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, KUBE_VERSION, strict=True)
    wrong = copy.deepcopy(deploy)
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBE_VERSION, strict=True)
