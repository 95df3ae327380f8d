"""The worker's OpenAI credentials go only to endpoints the operator configured; a spec names one.

Each test runs real loopback OpenAI-compatible servers that record the Authorization header of
every request, a real Redis and the real generation worker loop.
"""

from __future__ import annotations

import json

import pytest
from dfp_generation.settings import GenerationSettings
from dfp_generation.tasks import GenerationHandler, GenerationWorker
from dfp_shared.config import ConfigError, load_settings
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import PLAN_KEY, queue_job
from dfp_shared.specs.generate import GenerateSpec

from .conftest import read_jsonl, write_jsonl
from .openai_server import LoopbackOpenAI

WORKER_KEY = "sk-worker-secret-0123456789"
OTHER_KEY = "sk-other-endpoint-secret-987"


@pytest.fixture
def servers():
    started = [LoopbackOpenAI().start() for _ in range(2)]
    yield started
    for s in started:
        s.stop()


def prompts(tmp_path, n=3) -> str:
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(n)])
    return str(path)


def settings_for(redis_server, **extra) -> GenerationSettings:
    return GenerationSettings(redis_url=redis_server.url, backoff_base_s=0.01, backoff_max_s=0.05, lease_ms=2000,
                              checkpoint_interval_s=0.2, **extra)


def run_worker(redis_client, settings) -> None:
    GenerationWorker(GenerationHandler(redis_client, settings), block_ms=200).run(idle_exit_s=1.0)


def queue_raw_job(redis_client, spec: dict) -> str:
    """A job written straight into Redis, past the API's validation (anyone who can write to Redis can)."""
    job, _ = JobStore(redis_client).create("generate", spec, primary_unit="prompts")
    TaskQueue(redis_client, "generate").enqueue(job.id, PLAN_KEY, {"plan": True})
    return job.id


def test_a_spec_url_is_refused_and_the_worker_key_never_reaches_it(tmp_path, redis_server, redis_client, servers):
    configured, attacker = servers
    spec = {"prompts": prompts(tmp_path), "output": str(tmp_path / "o"), "engine": "openai",
            "openai_base_url": attacker.base_url, "openai_model": "m"}
    with pytest.raises(ValueError, match="openai_base_url.*openai_endpoint"):
        queue_job(redis_client, "generate", spec)

    job_id = queue_raw_job(redis_client, spec)
    run_worker(redis_client, settings_for(redis_server, openai_base_url=configured.base_url,
                                          openai_api_key=WORKER_KEY))
    rec = JobStore(redis_client).get(job_id)
    assert rec.state == JobState.failed and "times; last error" not in rec.error
    assert "openai_base_url" in rec.error and "openai_endpoint" in rec.error, rec.error
    assert attacker.authorizations == [] and configured.authorizations == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://169.254.169.254/latest", "vllm.svc:8000",
                                 "default/../x", ""])
def test_an_endpoint_name_is_a_name_not_an_address(url):
    with pytest.raises(ValueError, match="openai_endpoint"):
        GenerateSpec(prompts="/p", output="/o", engine="openai", openai_endpoint=url)


def test_the_schema_states_the_name_rule():
    from dfp_shared.specs import TrainSpec
    from dfp_shared.specs._names import NAME_PATTERN

    for model, field in ((GenerateSpec, "openai_endpoint"), (TrainSpec, "target_endpoint")):
        (string, _null) = model.model_json_schema()["properties"][field]["anyOf"]
        assert string == {"type": "string", "pattern": NAME_PATTERN, "maxLength": 64}, (field, string)


def test_jobs_pick_configured_endpoints_by_name_each_with_its_own_key(tmp_path, redis_server, redis_client, servers,
                                                                     monkeypatch):
    default, other = servers
    monkeypatch.setenv("TEST_OTHER_OPENAI_KEY", OTHER_KEY)
    settings = settings_for(redis_server, openai_base_url=default.base_url, openai_api_key=WORKER_KEY,
                            openai_model="m",
                            openai_endpoints=json.dumps({"other": {"url": other.base_url, "model": "other-model",
                                                                   "api_key_env": "TEST_OTHER_OPENAI_KEY"}}))
    base = {"prompts": prompts(tmp_path), "engine": "openai", "shard_size": 2, "concurrency": 1}
    unnamed, _ = queue_job(redis_client, "generate", {**base, "output": str(tmp_path / "a")})
    named, _ = queue_job(redis_client, "generate", {**base, "output": str(tmp_path / "b"),
                                                    "openai_endpoint": "other"})
    run_worker(redis_client, settings)
    jobs = JobStore(redis_client)
    assert jobs.get(unnamed.id).state == JobState.succeeded, jobs.get(unnamed.id).error
    assert jobs.get(named.id).state == JobState.succeeded, jobs.get(named.id).error
    assert default.authorizations == [f"Bearer {WORKER_KEY}"] * 3
    assert other.authorizations == [f"Bearer {OTHER_KEY}"] * 3
    assert {b["model"] for b in default.bodies} == {"m"} and {b["model"] for b in other.bodies} == {"other-model"}
    assert len(read_jsonl(tmp_path / "b" / "completions" / "shard-00000.jsonl")) == 2


def test_a_key_file_is_read_and_an_endpoint_without_a_key_gets_no_header(tmp_path, redis_server, redis_client,
                                                                        servers):
    keyed, open_ = servers
    key_file = tmp_path / "secret" / "api-key"
    key_file.parent.mkdir()
    key_file.write_text(OTHER_KEY + "\n")
    settings = settings_for(redis_server, openai_api_key=WORKER_KEY, openai_endpoints=json.dumps({
        "keyed": {"url": keyed.base_url, "api_key_file": str(key_file)}, "open": open_.base_url}))
    base = {"prompts": prompts(tmp_path, 1), "engine": "openai", "openai_model": "m"}
    for name in ("keyed", "open"):
        job, _ = queue_job(redis_client, "generate", {**base, "output": str(tmp_path / name),
                                                      "openai_endpoint": name})
        run_worker(redis_client, settings)
        assert JobStore(redis_client).get(job.id).state == JobState.succeeded
    # the default endpoint's key (DFLASH_OPENAI_API_KEY) goes to the default endpoint only (each job asks the
    # endpoint's /metrics for its capacity, then the completion)
    assert keyed.authorizations == [f"Bearer {OTHER_KEY}"] * 2 and open_.authorizations == [None] * 2


def test_an_unknown_name_fails_the_job_at_once_naming_the_configured_ones(tmp_path, redis_server, redis_client,
                                                                         servers):
    default, other = servers
    settings = settings_for(redis_server, openai_base_url=default.base_url, openai_api_key=WORKER_KEY,
                            openai_endpoints=json.dumps({"other": other.base_url}))
    job, _ = queue_job(redis_client, "generate", {"prompts": prompts(tmp_path), "output": str(tmp_path / "o"),
                                                  "engine": "openai", "openai_model": "m",
                                                  "openai_endpoint": "elsewhere"})
    run_worker(redis_client, settings)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.failed
    assert "'elsewhere'" in rec.error and "'default'" in rec.error and "'other'" in rec.error, rec.error
    assert "times; last error" not in rec.error  # failed at once, not dead-lettered after retries
    assert default.authorizations == [] and other.authorizations == []


@pytest.mark.parametrize("env, reason", [
    ({"DFLASH_OPENAI_ENDPOINTS": "{not json"}, "not a JSON object"),
    ({"DFLASH_OPENAI_ENDPOINTS": '{"a b": "http://x:1/v1"}'}, "'a b'"),
    ({"DFLASH_OPENAI_ENDPOINTS": '{"x": "ftp://x/v1"}'}, "http:// or https://"),
    ({"DFLASH_OPENAI_ENDPOINTS": '{"x": "http://user:pw@x/v1"}'}, "user"),
    ({"DFLASH_OPENAI_ENDPOINTS": '{"x": {"url": "http://x/v1", "api_key_env": "DFP_TEST_UNSET_VAR"}}'},
     "DFP_TEST_UNSET_VAR"),
    ({"DFLASH_OPENAI_ENDPOINTS": '{"x": {"url": "http://x/v1", "token": "t"}}'}, "token"),
    ({"DFLASH_OPENAI_ENDPOINTS": '{"default": "http://x/v1"}', "DFLASH_OPENAI_BASE_URL": "http://y/v1"},
     "DFLASH_OPENAI_BASE_URL"),
    ({"DFLASH_OPENAI_BASE_URL": "localhost:8000"}, "http:// or https://"),
])
def test_bad_endpoint_settings_refuse_to_start_naming_the_variable(monkeypatch, env, reason):
    monkeypatch.delenv("DFP_TEST_UNSET_VAR", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        load_settings(GenerationSettings)
    var = "DFLASH_OPENAI_BASE_URL" if "DFLASH_OPENAI_ENDPOINTS" not in env else "DFLASH_OPENAI_ENDPOINTS"
    assert var in str(err.value) and reason in str(err.value), str(err.value)


def test_the_api_answers_422_naming_the_removed_fields(redis_server, tmp_path):
    from dfp_api.app import create_app
    from dfp_api.settings import ApiSettings
    from fastapi.testclient import TestClient

    from tests.api.conftest import WRITE_KEY, auth, key_entries

    settings = ApiSettings(redis_url=redis_server.url, api_keys=key_entries(), storage_url=f"file://{tmp_path}",
                           rate_limit_per_s=1000.0, rate_limit_burst=1000)
    gen = {"prompts": f"file://{tmp_path}/p.jsonl", "output": f"file://{tmp_path}/o", "engine": "openai"}
    with TestClient(create_app(settings), headers=auth(WRITE_KEY)) as api:
        resp = api.post("/v1/jobs", json={"type": "generate", "spec": {
            **gen, "openai_base_url": "http://169.254.169.254/latest"}})
        assert resp.status_code == 422, resp.text
        assert "openai_base_url: no longer accepted" in resp.json()["message"]
        assert "openai_endpoint" in resp.json()["message"]
        resp = api.post("/v1/jobs", json={"type": "generate", "spec": {**gen, "openai_endpoint": "http://127.0.0.1:1"}})
        assert resp.status_code == 422 and resp.json()["fields"][0]["field"] == "spec.openai_endpoint", resp.text
        resp = api.post("/v1/jobs", json={"type": "train", "spec": {
            "dataset": f"file://{tmp_path}/d", "target": f"file://{tmp_path}/t", "target_url": "10.0.0.1:50051"}})
        assert resp.status_code == 422 and "target_endpoint" in resp.json()["message"], resp.text
