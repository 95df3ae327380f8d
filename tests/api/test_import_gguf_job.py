"""The import_gguf job through the API: a GGUF file in storage (S3 or disk) imported by the trainer workers into
the model the CLI import gives; storage roots, owners and bad files handled as every job handles them."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.worker import Worker
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.storage.store import open_store
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler
from fastapi.testclient import TestClient

from tests.support.gguf_file import write_tiny_llama_gguf

from .conftest import WRITE_KEY, auth, served
from .test_jobs import fields_of
from .test_principals import OTHER_KEY, entries

PROMPT = [{"role": "user", "content": "Hello! The quick brown fox."}]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_llama_gguf(path)


def _worker(redis_server, redis_client, **settings) -> Worker:
    config = TrainerSettings(redis_url=redis_server.url, device="cpu", **settings)
    return Worker(TaskQueue(redis_client, "train", lease_ms=config.lease_ms), JobStore(redis_client),
                  TrainHandler(config, redis_client), heartbeat_s=0.5)


def _submit(client, spec: dict, key: str = WRITE_KEY) -> str:
    resp = client.post("/v1/jobs", json={"type": "import_gguf", "spec": spec}, headers=auth(key))
    assert resp.status_code == 201, resp.text
    assert resp.json()["primary_unit"] == "phases"
    return resp.json()["id"]


def _logits(model, tokenizer):
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        return model(ids).logits


def _snapshot(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_an_import_job_on_s3_gives_the_model_the_cli_import_gives(
        s3_server, s3_bucket, api, redis_server, redis_client, tmp_path, tiny_gguf, monkeypatch):
    from dfp_cli.main import cli
    from transformers import AutoTokenizer

    path, original = tiny_gguf
    endpoint = s3_server.endpoint_url
    open_store(s3_bucket, endpoint_url=endpoint).put_file("incoming/tiny.gguf", path)
    output = f"{s3_bucket}/models/tiny"
    job_id = _submit(api, {"source": f"{s3_bucket}/incoming/tiny.gguf", "output": output})

    assert _worker(redis_server, redis_client, s3_endpoint_url=endpoint,
                   work_dir=str(tmp_path / "work")).run(max_tasks=1, idle_exit_s=5) == 1
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "succeeded", job["error"]
    assert job["outputs"] == {"model": output}
    assert job["progress"]["units"]["phases"]["done"] == 3 == job["progress"]["units"]["phases"]["total"]
    assert job["counters"]["source_bytes"] == path.stat().st_size and job["counters"]["files"] >= 4
    phases = [data["phase"] for _, kind, data in JobStore(redis_client).events(job_id) if kind == "phase"]
    assert phases == ["fetched", "converted", "written"]
    assert list((tmp_path / "work").iterdir()) == []  # the download and the conversion are cleaned up
    keys = set(open_store(output, endpoint_url=endpoint).list(""))
    assert {"config.json", "model.safetensors", "tokenizer.json", ".dflash-owner.json"} <= keys
    assert not any(k.endswith((".py", ".bin", ".pt")) for k in keys)

    (tmp_path / "t.gguf").write_bytes(path.read_bytes())
    monkeypatch.setenv("DFLASH_STORAGE_URL", f"file://{tmp_path}")
    by_cli = CliRunner().invoke(cli, ["models", "import-gguf", "--source", f"file://{tmp_path}/t.gguf",
                                      "--output", f"file://{tmp_path}/cli-model"])
    assert by_cli.exit_code == 0, by_cli.output

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "cli-model")
    from_job = _logits(load_causal_lm(output, device="cpu", endpoint_url=endpoint), tokenizer)
    assert torch.equal(from_job, _logits(load_causal_lm(str(tmp_path / "cli-model"), device="cpu"), tokenizer))
    assert torch.equal(from_job, _logits(original, tokenizer))


def test_uris_outside_the_roots_are_refused_with_422_naming_the_field(api, tmp_path):
    base = {"source": f"file://{tmp_path}/in/t.gguf", "output": f"file://{tmp_path}/models/t"}
    for field in ("source", "output"):
        got = fields_of(api.post("/v1/jobs", json={"type": "import_gguf", "spec": {**base, field: "file:///etc/x.gguf"}}))
        assert list(got) == [f"spec.{field}"] and "outside the allowed storage" in got[f"spec.{field}"], field
    dotted = fields_of(api.post("/v1/jobs", json={"type": "import_gguf", "spec": {
        **base, "source": f"file://{tmp_path}/in/../../../etc/x.gguf"}}))
    assert list(dotted) == ["spec.source"]
    extra = fields_of(api.post("/v1/jobs", json={"type": "import_gguf", "spec": {**base, "trust_remote_code": True}}))
    assert list(extra) == ["spec.trust_remote_code"]
    schema = api.get("/openapi.json").json()["components"]["schemas"]
    assert set(schema["ImportGGUFSpec"]["required"]) == {"source"}
    assert schema["ImportGGUFJobRequest"]["properties"]["type"]["const"] == "import_gguf"


def test_the_worker_refuses_a_source_outside_the_roots_before_any_io(redis_server, redis_client, tmp_path):
    # queued straight into Redis, past the API's check
    job, _ = queue_job(redis_client, "import_gguf", {"source": "file:///etc/passwd",
                                                     "output": f"file://{tmp_path}/models/t"})
    assert _worker(redis_server, redis_client).run(max_tasks=1, idle_exit_s=5) == 1
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.failed and "spec.source" in rec.error and "outside" in rec.error
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("damage", ["truncated", "not_gguf", "oversized"])
def test_a_bad_file_fails_the_job_at_once_naming_it(damage, s3_server, s3_bucket, api, redis_server, redis_client,
                                                    tmp_path, tiny_gguf):
    path, _ = tiny_gguf
    data = path.read_bytes()
    body, settings, reason, fetched = {
        "truncated": (data[:200], {}, "malformed GGUF", 1),
        "not_gguf": (b"PK\x03\x04" + data[4:], {}, "not a GGUF file", 1),
        # refused by the object's length, before it is downloaded
        "oversized": (data, {"gguf_max_bytes": len(data) - 1}, "over the import limit", 0),
    }[damage]
    endpoint = s3_server.endpoint_url
    open_store(s3_bucket, endpoint_url=endpoint).put("in/bad.gguf", body)
    source, output = f"{s3_bucket}/in/bad.gguf", f"{s3_bucket}/models/{damage}"
    job_id = _submit(api, {"source": source, "output": output})

    worker = _worker(redis_server, redis_client, s3_endpoint_url=endpoint, **settings)
    assert worker.run(max_tasks=1, idle_exit_s=5) == 1
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "failed" and f"{source}: " in job["error"] and reason in job["error"], job["error"]
    assert job["counters"].get("phases", 0) == fetched
    queue = worker.queue
    assert redis_client.xlen(queue.stream) == 0 and redis_client.xlen(queue.dead_stream) == 0  # not retried
    assert set(open_store(output, endpoint_url=endpoint).list("")) == {".dflash-owner.json"}


def test_another_principal_s_model_is_not_overwritten(make_app, redis_server, redis_client, tmp_path, tiny_gguf):
    path, _ = tiny_gguf
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "t.gguf").write_bytes(path.read_bytes())
    spec = {"source": f"file://{tmp_path}/in/t.gguf", "output": f"file://{tmp_path}/models/t"}
    with TestClient(make_app(api_keys=entries())) as client:
        mine = _submit(client, spec)
        assert _worker(redis_server, redis_client).run(max_tasks=1, idle_exit_s=5) == 1
        assert client.get(f"/v1/jobs/{mine}", headers=auth(WRITE_KEY)).json()["state"] == "succeeded"
        before = _snapshot(tmp_path / "models" / "t")

        theirs = _submit(client, spec, key=OTHER_KEY)
        assert _worker(redis_server, redis_client).run(max_tasks=1, idle_exit_s=5) == 1
        job = client.get(f"/v1/jobs/{theirs}", headers=auth(OTHER_KEY)).json()
    assert job["state"] == "failed" and "belongs to 'writer'" in job["error"], job["error"]
    assert _snapshot(tmp_path / "models" / "t") == before


def test_the_job_client_submits_an_import(make_app, redis_client, tmp_path, monkeypatch):
    from dfp_cli.main import cli

    source, output = f"file://{tmp_path}/in/t.gguf", f"file://{tmp_path}/models/t"
    with served(make_app()) as port:
        monkeypatch.setenv("DFLASH_API_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("DFLASH_API_KEY", WRITE_KEY)
        made = CliRunner().invoke(cli, ["submit", "import_gguf", "--source", source, "--output", output, "--json"])
    assert made.exit_code == 0, made.output
    job = json.loads(made.output)
    assert job["type"] == "import_gguf" and job["spec"] == {"source": source, "output": output}
    assert JobStore(redis_client).get(job["id"]).state == JobState.queued
