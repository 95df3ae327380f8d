"""The adaptation loop in the chart: off by default; on, a CronJob that never overlaps, runs hardened like the
other pods, and hands the run the settings ``dflash-pipeline adapt run`` reads."""

from __future__ import annotations

import json

import helm_python
import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from tests.support.chart import CHART_DIR, render, render_objects, strip_template

SPEC = {"tokenize": {"tokenizer": "s3://dflash-pipeline/models/qwen3"},
        "train": {"target": "s3://dflash-pipeline/models/qwen3", "steps": 2000},
        "evaluate": {"target": "s3://dflash-pipeline/models/qwen3", "max_new_tokens": 256},
        "generate": {"model": "s3://dflash-pipeline/models/qwen3", "engine": "openai"}}
VALUES = {
    "adapt": {"enabled": True, "schedule": "30 2 * * 1", "name": "qwen3-8b", "windowHours": 48, "heldoutShare": 0.05,
              "regenerate": False, "minGain": 0.05, "alpha": 0.01, "minPrompts": 12,
              "stepCosts": {"target_step_s": 0.05, "draft_step_s": 0.01, "ngram_step_s": 0.001}, "served": "s3://dflash-pipeline/data/serving",
              "spec": SPEC, "pollSeconds": 15, "activeDeadlineSeconds": 43200},
    "capture": {"enabled": True, "upstream": "http://vllm.inference.svc:8000",
                "prefix": "s3://dflash-pipeline/data/traffic", "retentionHours": 72},
    "storage": {"s3": {"existingSecret": "s3-keys"}},
}


def _adapt(objects: list[dict], kind: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == "dflash-adapt")


@pytest.fixture(scope="module")
def enabled() -> list[dict]:
    return render_objects(VALUES)


def _env(container: dict, config_map: dict) -> dict[str, str]:
    env = dict(config_map["data"])
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    return env


def test_disabled_by_default_renders_nothing():
    assert all(not text.strip() for path, text in render().items() if "/adapt-" in path)


def test_a_cronjob_that_never_overlaps_and_is_valid_kubernetes(enabled):
    cron = _adapt(enabled, "CronJob")
    assert cron["spec"]["schedule"] == "30 2 * * 1" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    job = cron["spec"]["jobTemplate"]["spec"]
    assert job["backoffLimit"] == 0 and job["activeDeadlineSeconds"] == 43200
    for obj in (cron, _adapt(enabled, "ConfigMap")):
        kubernetes_validate.validate(strip_template(obj), latest_version(), strict=True)


def test_runs_hardened_like_the_other_pods(enabled):
    pod = _adapt(enabled, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    api = next(o for o in enabled if o["kind"] == "Deployment" and o["metadata"]["name"] == "dflash-api")
    assert pod["securityContext"] == api["spec"]["template"]["spec"]["securityContext"]
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["securityContext"] == api["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["command"] == ["dflash-pipeline"] and c["args"] == ["adapt", "run"] and "cuda" not in c["image"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_values_become_the_settings_the_run_reads(enabled, monkeypatch, tmp_path):
    from dfp_adapt.cli import _stages
    from dfp_adapt.settings import AdaptSettings

    cron = _adapt(enabled, "CronJob")
    (c,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    config = next(o for o in enabled if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "dflash-config")
    for name, value in _env(c, config).items():
        if name.startswith("DFLASH_"):
            monkeypatch.setenv(name, value)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert refs["DFLASH_API_KEY"] == {"name": "dflash-api-keys", "key": "adapt-key"}
    assert refs["AWS_ACCESS_KEY_ID"]["name"] == "s3-keys"
    monkeypatch.setenv("DFLASH_API_KEY", "dfp_key")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(_adapt(enabled, "ConfigMap")["data"]["spec.json"])
    monkeypatch.setenv("DFLASH_ADAPT_SPEC", str(spec_file))
    settings = AdaptSettings()
    assert settings.api_url == "http://dflash-api:80" and settings.api_key.get_secret_value() == "dfp_key"
    assert settings.adapt_name == "qwen3-8b" and settings.served() == "s3://dflash-pipeline/data/serving"
    assert settings.capture() == "s3://dflash-pipeline/data/traffic"  # capture.prefix, as the pass-through writes
    assert settings.runs() == "s3://dflash-pipeline/data/adapt"
    assert (settings.adapt_window_hours, settings.adapt_heldout_share) == (48, 0.05)
    assert settings.adapt_regenerate is False
    assert (settings.adapt_min_gain, settings.adapt_alpha, settings.adapt_min_prompts, settings.adapt_poll_s) == \
           (0.05, 0.01, 12, 15)
    assert settings.adapt_step_costs.model_dump() == VALUES["adapt"]["stepCosts"]
    assert settings.adapt_retention_hours == 72  # the capture's own
    assert _stages(settings.adapt_spec) == SPEC


def test_an_own_api_key_secret_is_required_with_an_own_key_set():
    values = {"adapt": {"enabled": True}, "api": {"auth": {"existingSecret": "my-keys"}}}
    with helm_python.Chart.load(str(CHART_DIR)) as chart, pytest.raises(helm_python.HelmError) as err:
        chart.render(values, name="dflash", namespace="dflash")
    assert "adapt.apiKeySecret is required" in str(err.value)
    values["adapt"].update(apiKeySecret="ci-key", apiKeySecretKey="key")
    cron = _adapt(render_objects(values), "CronJob")
    (c,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert next(e for e in c["env"] if e["name"] == "DFLASH_API_KEY")["valueFrom"]["secretKeyRef"] == \
           {"name": "ci-key", "key": "key"}


@pytest.mark.parametrize("adapt, where", [
    ({"schedule": "daily"}, "/adapt/schedule"),
    ({"windowHours": 0}, "/adapt/windowHours"),
    ({"windowHours": 745}, "/adapt/windowHours"),
    ({"heldoutShare": 0.9}, "/adapt/heldoutShare"),
    ({"alpha": 0.6}, "/adapt/alpha"),
    ({"minPrompts": 1}, "/adapt/minPrompts"),
    ({"minGain": -0.1}, "/adapt/minGain"),
    ({"stepCosts": {"target_step_s": 0}}, "/adapt/stepCosts/target_step_s"),
    ({"stepCosts": {"other_s": 1}}, "/adapt/stepCosts"),
    ({"name": "../x"}, "/adapt/name"),
    ({"served": "/local/path"}, "/adapt/served"),
    ({"spec": {"train": {"steps": 1}, "deploy": {}}}, "/adapt/spec"),
    ({"principal": "no spaces"}, "/adapt/principal"),
])
def test_schema_rejects_bad_adapt_values(adapt, where):
    with helm_python.Chart.load(str(CHART_DIR)) as chart, pytest.raises(helm_python.HelmError) as err:
        chart.validate_schema(chart.merge_values({"adapt": {"enabled": True, **adapt}}))
    assert f"at '{where}'" in str(err.value), str(err.value)


def test_default_settings_match_the_run_defaults(monkeypatch):
    from dfp_adapt.settings import AdaptSettings

    objects = render_objects({"adapt": {"enabled": True}})
    cron = _adapt(objects, "CronJob")
    (c,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert "DFLASH_ADAPT_SERVED" not in env and "DFLASH_ADAPT_CAPTURE_PREFIX" not in env
    assert json.loads(_adapt(objects, "ConfigMap")["data"]["spec.json"]) == {}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = AdaptSettings()
    fields = AdaptSettings.model_fields
    for field in ("adapt_name", "adapt_window_hours", "adapt_heldout_share", "adapt_regenerate", "adapt_min_gain",
                  "adapt_alpha", "adapt_min_prompts", "adapt_step_costs", "adapt_retention_hours"):
        assert getattr(settings, field) == fields[field].get_default(call_default_factory=True), field


def _secret(objects: list[dict]) -> dict[str, str]:
    import base64

    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "dflash-api-keys")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_the_loop_runs_with_a_key_of_its_own_that_is_not_admin(enabled):
    import hashlib

    data = _secret(enabled)
    entries = {e["name"]: e for e in json.loads(data["api-keys"])}
    assert entries["adapt"]["scopes"] == ["read", "write"]
    assert entries["adapt"]["sha256"] == hashlib.sha256(data["adapt-key"].encode()).hexdigest()
    assert data["adapt-key"] != data["admin-key"] and entries["admin"]["scopes"] == ["read", "write", "admin"]
    assert "adapt-key" not in _secret(render_objects({}))  # no loop, no key for it
    (c,) = _adapt(enabled, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    names = {e["name"] for e in c["env"]}
    assert "DFLASH_REDIS_PASSWORD" not in names and "DFLASH_REDIS_URL" not in names  # it never talks to Redis


def test_the_loop_s_prefixes_are_kept_for_its_key_and_the_traffic_for_none(enabled, monkeypatch):
    from dfp_api.settings import ApiSettings
    from dfp_shared.storage.roots import StorageRoots

    config = next(o for o in enabled if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "dflash-config")
    assert json.loads(config["data"]["DFLASH_RESERVED_PREFIXES"]) == {
        "s3://dflash-pipeline/data/serving": "adapt", "s3://dflash-pipeline/data/adapt": "adapt",
        "s3://dflash-pipeline/data/traffic": ""}
    for name, value in config["data"].items():
        monkeypatch.setenv(name, value)
    roots = StorageRoots.from_settings(ApiSettings(auth_disabled=True))
    assert roots.reserved["s3://dflash-pipeline/data/traffic"] is None
    # the operator's own reservations join them; with neither the loop nor the capture on, none by default
    objects = render_objects({"adapt": {"enabled": True, "principal": "loop"},
                              "storage": {"reservedPrefixes": {"s3://dflash-pipeline/data/eval": "qa"}}})
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "dflash-config")
    assert json.loads(config["data"]["DFLASH_RESERVED_PREFIXES"]) == {
        "s3://dflash-pipeline/data/served": "loop", "s3://dflash-pipeline/data/adapt": "loop",
        "s3://dflash-pipeline/data/capture": "", "s3://dflash-pipeline/data/eval": "qa"}
    assert json.loads(_secret(objects)["api-keys"])[1]["name"] == "loop"
    config = next(o for o in render_objects({}) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "dflash-config")
    assert "DFLASH_RESERVED_PREFIXES" not in config["data"]


@pytest.mark.parametrize("values, reason", [
    ({"adapt": {"enabled": True, "principal": "Anonymous"}}, "must not be anonymous"),
    ({"adapt": {"enabled": True, "principal": "admin"}}, "must not be admin"),
])
def test_a_principal_no_key_may_be_fails_the_render(values, reason):
    with helm_python.Chart.load(str(CHART_DIR)) as chart, pytest.raises(helm_python.HelmError) as err:
        chart.render(values, name="dflash", namespace="dflash")
    assert reason in str(err.value)


def test_the_capture_retention_is_bounded_as_the_runs_read_it():
    from dfp_adapt.settings import MAX_RETENTION_HOURS

    with helm_python.Chart.load(str(CHART_DIR)) as chart, pytest.raises(helm_python.HelmError) as err:
        chart.validate_schema(chart.merge_values({"capture": {"retentionHours": MAX_RETENTION_HOURS + 1}}))
    assert "at '/capture/retentionHours'" in str(err.value)


def _notes(values: dict) -> str:
    return next(text for path, text in render(values).items() if path.endswith("NOTES.txt"))


def test_the_notes_serve_the_drafter_through_the_pointer(tmp_path):
    """Serving resolves the pointer as each serving pod starts: the release's notes give the line that copies the
    served version down and writes the speculative config, and that line works against a served store."""
    import shlex

    from click.testing import CliRunner
    from dfp_adapt.served_store import ServedDrafters
    from dfp_cli.main import cli

    from tests.shared.test_promotion import write_export

    assert "adapt serving-config" not in _notes({})
    served = f"file://{tmp_path}/it's served"  # a quote in the location stays one shell word
    notes = _notes({"adapt": {"enabled": True, "name": "qwen3-8b", "served": served},
                    "storage": {"url": f"file://{tmp_path}"}})
    assert "current.json" in notes and "current/" not in notes
    (line,) = [ln.strip() for ln in notes.splitlines() if ln.strip().startswith("dflash-pipeline adapt serving-config")]
    write_export(f"file://{tmp_path}/c1", 1)
    ServedDrafters(served, "qwen3-8b").promote(f"file://{tmp_path}/c1/", {})
    argv = shlex.split(line.replace("/drafter/", f"{tmp_path}/pod/"))
    assert argv[:3] == ["dflash-pipeline", "adapt", "serving-config"] and argv[-2] == ">"
    out = CliRunner().invoke(cli, argv[1:-2], env={"DFLASH_STORAGE_URL": f"file://{tmp_path}",
                                                   "DFLASH_LOG_JSON": "false"})
    assert out.exit_code == 0, out.stderr
    assert (tmp_path / "pod" / "spec.json").as_posix() == argv[-1]
    assert json.loads(out.stdout) == {"method": "dflash", "model": f"{tmp_path}/pod/model",
                                      "num_speculative_tokens": 15}
    assert (tmp_path / "pod" / "model" / "config.json").read_bytes() == \
           (tmp_path / "it's served" / "qwen3-8b" / "versions" / "1" / "config.json").read_bytes()
