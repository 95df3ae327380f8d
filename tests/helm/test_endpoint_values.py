"""The chart's named endpoints: generation.openai.endpoints and trainer.targetEndpoints become the
settings the workers read (each token from its own Secret), and the schema refuses bad entries."""

from __future__ import annotations

import helm_python
import pytest

from tests.support.chart import CHART_DIR, render_objects, workloads_from_objects

VALUES = {
    "generation": {"engine": "openai", "openai": {
        "baseUrl": "http://vllm.inference.svc:8000/v1", "existingSecret": "vllm-key",
        "endpoints": {"big": {"baseUrl": "https://big.inference.svc/v1", "model": "Qwen/Qwen3-32B",
                              "existingSecret": "big-key", "secretKey": "token"},
                      "open": {"baseUrl": "http://open.inference.svc:8000/v1"}}}},
    "trainer": {"targetMode": "disaggregated", "targetEndpoints": {"local": "inprocess", "pool": "a:1,b:2"}},
}


def container(objects, component: str) -> dict:
    workload = next(w for w in workloads_from_objects(objects) if w["component"] == component)
    return workload["containers"][0]


@pytest.fixture(scope="module")
def objects():
    return render_objects(VALUES)


def test_generation_endpoints_reach_the_worker_settings_with_their_own_secrets(objects, monkeypatch):
    from dfp_generation.settings import GenerationSettings

    c = container(objects, "generation")
    assert c["env_refs"]["DFLASH_OPENAI_API_KEY"] == {"secretKeyRef": {"name": "vllm-key", "key": "api-key"}}
    key_vars = {name: ref for name, ref in c["env_refs"].items() if name.startswith("DFLASH_OPENAI_ENDPOINT_KEY_")}
    assert list(key_vars.values()) == [{"secretKeyRef": {"name": "big-key", "key": "token"}}]
    # what the kubelet does: literal values, plus each Secret's value in its variable
    for name, value in c["env"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DFLASH_OPENAI_API_KEY", "default-token")
    for name in key_vars:
        monkeypatch.setenv(name, "big-token")
    endpoints = GenerationSettings().openai_endpoint_map()
    assert {n: e.url for n, e in endpoints.items()} == {
        "default": "http://vllm.inference.svc:8000/v1", "big": "https://big.inference.svc/v1",
        "open": "http://open.inference.svc:8000/v1"}
    assert [endpoints[n].token() for n in ("default", "big", "open")] == ["default-token", "big-token", None]
    assert endpoints["big"].model == "Qwen/Qwen3-32B"


def test_trainer_target_endpoints_reach_the_trainer_settings(objects, monkeypatch):
    from dfp_trainer.settings import TrainerSettings

    for name, value in container(objects, "trainer")["env"].items():
        monkeypatch.setenv(name, value)
    settings = TrainerSettings()
    assert settings.target_endpoint_map() == {"default": "dns:///dflash-target-headless.dflash.svc:50051",
                                              "local": "inprocess", "pool": "a:1,b:2"}


def test_no_named_endpoints_by_default():
    objects = render_objects({})
    assert "DFLASH_OPENAI_ENDPOINTS" not in container(objects, "generation")["env"]
    assert "DFLASH_TARGET_ENDPOINTS" not in container(objects, "trainer")["env"]


@pytest.mark.parametrize("values, where", [
    ({"generation": {"openai": {"endpoints": {"default": {"baseUrl": "http://x/v1"}}}}},
     "/generation/openai/endpoints/default"),
    ({"generation": {"openai": {"endpoints": {"a b": {"baseUrl": "http://x/v1"}}}}}, "/generation/openai/endpoints"),
    ({"generation": {"openai": {"endpoints": {"x": {"baseUrl": "http://u:p@x/v1"}}}}},
     "/generation/openai/endpoints/x/baseUrl"),
    ({"generation": {"openai": {"endpoints": {"x": {"model": "m"}}}}}, "/generation/openai/endpoints/x"),
    ({"generation": {"openai": {"endpoints": {"x": {"baseUrl": "http://x/v1", "apiKey": "k"}}}}},
     "/generation/openai/endpoints/x"),
    ({"trainer": {"targetEndpoints": {"default": "x:1"}}}, "/trainer/targetEndpoints/default"),
    ({"trainer": {"targetEndpoints": {"x": ""}}}, "/trainer/targetEndpoints/x"),
])
def test_schema_refuses_bad_endpoint_values(values, where):
    with helm_python.Chart.load(str(CHART_DIR)) as chart, pytest.raises(helm_python.HelmError) as err:
        chart.render(values, name="dflash", namespace="dflash")
    assert f"at '{where}" in str(err.value), str(err.value)
