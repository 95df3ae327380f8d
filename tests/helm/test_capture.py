"""The capture pass-through in the chart: off by default; on, a hardened Deployment and a Service whose
settings are the ones the service reads, and a clear failure without an upstream."""

from __future__ import annotations

import json

import helm_python
import pytest

from tests.support.chart import CHART_DIR, render, render_objects, workloads_from_objects

UPSTREAM = "http://vllm.inference.svc:8000"
VALUES = {
    "capture": {
        "enabled": True, "upstream": UPSTREAM, "replicas": 3, "port": 8200, "captureAll": True,
        "header": "X-Record-Me", "sampleRate": 0.25, "redact": [r"sk-[A-Za-z0-9]{20,}", r"\b\d{16}\b"],
        "retentionHours": 48, "prefix": "s3://dflash-pipeline/data/traffic",
        "buffer": {"records": 500, "bytes": 67108864, "flushIntervalSeconds": 5, "maxBodyBytes": 8388608,
                   "maxRecordBytes": 2097152},
        "service": {"port": 9000}, "env": {"DFLASH_CAPTURE_MAX_CHOICES": 4},
    },
    "storage": {"s3": {"existingSecret": "s3-keys"}},
}


def _capture(objects: list[dict], kind: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == "dflash-capture")


@pytest.fixture(scope="module")
def enabled() -> list[dict]:
    return render_objects(VALUES)


def test_disabled_by_default_renders_nothing():
    rendered = render()
    assert all(not text.strip() for path, text in rendered.items() if "/capture-" in path)
    assert not [o for o in render_objects() if o["metadata"]["labels"].get("app.kubernetes.io/component") == "capture"]


def test_enabled_without_an_upstream_fails_clearly():
    with helm_python.Chart.load(str(CHART_DIR)) as chart, pytest.raises(helm_python.HelmError) as err:
        chart.render({"capture": {"enabled": True}}, name="dflash", namespace="dflash")
    assert "capture.upstream is required when capture.enabled is true" in str(err.value)


@pytest.mark.parametrize("capture, where", [
    ({"upstream": "vllm:8000"}, "/capture/upstream"),
    ({"sampleRate": 1.5}, "/capture/sampleRate"),
    ({"header": "X Capture"}, "/capture/header"),
    ({"buffer": {"bytes": 10}}, "/capture/buffer/bytes"),
    ({"redact": ["x" * 513]}, "/capture/redact/0"),
])
def test_schema_rejects_bad_capture_values(capture, where):
    with helm_python.Chart.load(str(CHART_DIR)) as chart, pytest.raises(helm_python.HelmError) as err:
        chart.render({"capture": {"enabled": True, "upstream": UPSTREAM, **capture}}, name="dflash", namespace="dflash")
    assert f"at '{where}'" in str(err.value), str(err.value)


def test_values_become_the_settings_the_service_reads(enabled, monkeypatch):
    from dfp_capture.settings import CaptureSettings

    capture = next(w for w in workloads_from_objects(enabled) if w["component"] == "capture")
    assert capture["replicas"] == 3
    (container,) = capture["containers"]
    assert container["command"] == ["dflash-pipeline"] and container["args"] == ["capture", "serve"]
    assert "cuda" not in container["image"]
    env = container["env"]
    assert env["DFLASH_CAPTURE_UPSTREAM"] == UPSTREAM
    assert json.loads(env["DFLASH_CAPTURE_REDACT"]) == VALUES["capture"]["redact"]
    for name, value in env.items():
        if name.startswith("DFLASH_"):
            monkeypatch.setenv(name, value)
    settings = CaptureSettings()
    assert settings.capture_upstream == UPSTREAM
    assert settings.capture_host == "0.0.0.0" and settings.capture_port == 8200
    assert settings.capture_enabled is True and settings.capture_header == "X-Record-Me"
    assert settings.capture_sample_rate == 0.25 and settings.capture_retention_hours == 48
    assert settings.redact_patterns() == VALUES["capture"]["redact"]
    assert settings.prefix() == "s3://dflash-pipeline/data/traffic"
    assert (settings.capture_queue_records, settings.capture_queue_bytes) == (500, 67108864)
    assert settings.capture_flush_interval_s == 5
    assert (settings.capture_max_body_bytes, settings.capture_max_record_bytes) == (8388608, 2097152)
    assert settings.capture_max_choices == 4
    # the storage credentials reach it as they reach the other storage-writing services
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert container["env_refs"][name]["secretKeyRef"]["name"] == "s3-keys"


def test_default_settings_match_the_service_defaults(monkeypatch):
    """Enabled with only an upstream, every value the chart sets is the service's own default, and the
    default prefix (<storage.url>/capture) lies inside the storage roots, outside the jobs' area."""
    from dfp_capture.settings import CaptureSettings
    from dfp_shared.storage.roots import StorageRoots

    capture = next(w for w in workloads_from_objects(render_objects({"capture": {"enabled": True, "upstream": UPSTREAM}}))
                   if w["component"] == "capture")
    env = capture["containers"][0]["env"]
    assert "DFLASH_CAPTURE_PREFIX" not in env and "DFLASH_CAPTURE_REDACT" not in env
    for name, value in env.items():
        if name.startswith("DFLASH_"):
            monkeypatch.setenv(name, value)
    settings = CaptureSettings()
    defaults = CaptureSettings.model_fields
    for field in ("capture_port", "capture_enabled", "capture_header", "capture_sample_rate",
                  "capture_retention_hours", "capture_queue_records", "capture_queue_bytes",
                  "capture_flush_interval_s", "capture_max_body_bytes", "capture_max_record_bytes"):
        assert getattr(settings, field) == defaults[field].default, field
    assert settings.prefix() == "s3://dflash-pipeline/data/capture"
    roots = StorageRoots.from_settings(settings)
    prefix = roots.check(settings.prefix(), "DFLASH_CAPTURE_PREFIX")
    roots.check_explicit_output(prefix, "DFLASH_CAPTURE_PREFIX")


def test_probes_and_service_reach_its_endpoints(enabled, tmp_path):
    from dfp_capture.service import build_app
    from dfp_capture.settings import CaptureSettings

    pod = _capture(enabled, "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["ports"] == [{"name": "http", "containerPort": 8200, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    app = build_app(CaptureSettings(storage_url=f"file://{tmp_path}"))
    assert {"/healthz", "/readyz", "/metrics"} <= {r.path for r in app.routes}
    svc = _capture(enabled, "Service")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == {**_capture(enabled, "Deployment")["spec"]["selector"]["matchLabels"]}
    pdb = _capture(enabled, "PodDisruptionBudget")
    assert pdb["spec"]["selector"] == _capture(enabled, "Deployment")["spec"]["selector"]


def test_runs_hardened_like_the_other_services(enabled):
    pod = _capture(enabled, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "dflash"
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_metrics_are_scraped_from_its_service():
    objects = render_objects({"capture": {"enabled": True, "upstream": UPSTREAM},
                              "metrics": {"serviceMonitor": {"enabled": True}}})
    monitor = _capture(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "http" and monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["selector"]["matchLabels"] == _capture(objects, "Service")["spec"]["selector"]
    assert not any(o["kind"] == "ServiceMonitor" and o["metadata"]["name"] == "dflash-capture" for o in render_objects(VALUES))
