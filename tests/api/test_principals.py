"""Principals: a job records who submitted it; keys see and cancel only their own jobs unless admin."""

from __future__ import annotations

import hashlib
import json

import pytest
from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from fastapi.testclient import TestClient

from .conftest import READ_KEY, WRITE_KEY, auth

OTHER_KEY = "dfp_test-other-writer-0123456789"
ADMIN_KEY = "dfp_test-admin-key-0123456789"

GEN = {"type": "generate", "spec": {"prompts": "file:///data/prompts.jsonl", "output": "file:///data/out",
                                    "model": "file:///models/tiny"}}
PIPE = {"type": "pipeline", "spec": {
    "generate": GEN["spec"], "tokenize": {"output": "file:///data/tokens", "tokenizer": "/models/tok"},
    "train": {"target": "/models/tiny", "output": "file:///data/drafter"}}}


def entries() -> str:
    def entry(name, key, scopes):
        return {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest(), "scopes": scopes}

    return json.dumps([entry("writer", WRITE_KEY, ["read", "write"]), entry("reader", READ_KEY, ["read"]),
                       entry("other", OTHER_KEY, ["read", "write"]), entry("root", ADMIN_KEY, ["admin"])])


@pytest.fixture
def client(make_app, redis_client):
    with TestClient(make_app(api_keys=entries())) as c:
        yield c


def _submit(client, key: str, body: dict = GEN) -> dict:
    resp = client.post("/v1/jobs", json=body, headers=auth(key))
    assert resp.status_code == 201, resp.text
    return resp.json()


def test_a_job_records_the_principal_that_submitted_it(client, redis_client):
    job = _submit(client, WRITE_KEY)
    assert job["owner"] == "writer"
    assert JobStore(redis_client).get(job["id"]).owner == "writer"
    assert redis_client.hget(f"dfp:job:{job['id']}", "owner") == "writer"
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth(WRITE_KEY)).json()["owner"] == "writer"


def test_pipeline_stages_inherit_the_pipeline_s_owner(redis_client):
    pipeline, _ = queue_job(redis_client, "pipeline", PIPE["spec"], owner="alice")
    jobs = JobStore(redis_client)
    assert pipeline.owner == "alice"
    generate = jobs.get(pipeline.outputs["generate_job"])
    assert generate.owner == "alice"
    jobs.start(generate.id)
    finish_job(redis_client, generate.id, "succeeded", outputs={"completions": "file:///data/out/completions/"})
    tokenize = jobs.get(jobs.get(pipeline.id).outputs["tokenize_job"])
    assert tokenize.owner == "alice" and tokenize.parent_id == pipeline.id


def test_a_read_only_key_cannot_list_read_watch_or_cancel_another_key_s_job(client, redis_client):
    job = _submit(client, WRITE_KEY)
    reader = auth(READ_KEY)
    page = client.get("/v1/jobs", headers=reader).json()
    assert page["total"] == 0 and page["items"] == []
    unknown = client.get("/v1/jobs/nosuchjob", headers=reader)
    got = client.get(f"/v1/jobs/{job['id']}", headers=reader)
    assert got.status_code == 404 and got.json()["error"] == unknown.json()["error"] == "not_found"
    assert client.get(f"/v1/jobs/{job['id']}/events", headers=reader).status_code == 404
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=reader).status_code in (403, 404)
    assert JobStore(redis_client).get(job["id"]).state.value == "queued"


def test_a_write_key_cannot_see_or_cancel_another_key_s_job(client, redis_client):
    job = _submit(client, WRITE_KEY)
    other = auth(OTHER_KEY)
    mine = _submit(client, OTHER_KEY)
    cancel = client.post(f"/v1/jobs/{job['id']}/cancel", headers=other)
    assert cancel.status_code == 404, cancel.text
    assert cancel.json() == {"error": "not_found", "message": f"no job {job['id']!r}"}
    assert JobStore(redis_client).get(job["id"]).state.value == "queued"
    assert not redis_client.exists(f"dfp:job:{job['id']}:cancel")
    assert client.get(f"/v1/jobs/{job['id']}", headers=other).status_code == 404
    assert client.get(f"/v1/jobs/{job['id']}/events", headers=other).status_code == 404
    page = client.get("/v1/jobs", headers=other).json()
    assert [j["id"] for j in page["items"]] == [mine["id"]] and page["total"] == 1
    # each sees its own
    assert [j["id"] for j in client.get("/v1/jobs", headers=auth(WRITE_KEY)).json()["items"]] == [job["id"]]
    assert client.post(f"/v1/jobs/{mine['id']}/cancel", headers=other).json()["state"] == "cancelled"


def test_a_pipeline_s_stages_are_visible_to_its_owner_only(client):
    pipeline = _submit(client, WRITE_KEY, PIPE)
    stage_id = pipeline["outputs"]["generate_job"]
    stage = client.get(f"/v1/jobs/{stage_id}", headers=auth(WRITE_KEY)).json()
    assert stage["owner"] == "writer" and stage["parent_id"] == pipeline["id"]
    assert client.get(f"/v1/jobs/{stage_id}", headers=auth(OTHER_KEY)).status_code == 404
    assert client.post(f"/v1/jobs/{stage_id}/cancel", headers=auth(OTHER_KEY)).status_code == 404


def test_an_admin_key_sees_and_cancels_every_job_and_may_submit(client):
    a, b = _submit(client, WRITE_KEY), _submit(client, OTHER_KEY)
    admin = auth(ADMIN_KEY)
    page = client.get("/v1/jobs", headers=admin).json()
    assert {j["id"] for j in page["items"]} == {a["id"], b["id"]}
    assert client.get(f"/v1/jobs/{a['id']}", headers=admin).json()["owner"] == "writer"
    assert client.post(f"/v1/jobs/{b['id']}/cancel", headers=admin).json()["state"] == "cancelled"
    own = _submit(client, ADMIN_KEY)
    assert own["owner"] == "root"
    with client.stream("GET", f"/v1/jobs/{b['id']}/events", headers=admin) as stream:
        assert stream.status_code == 200 and "event: end" in stream.read().decode()


def test_jobs_without_an_owner_are_visible_to_admins_only(client, redis_client):
    legacy, _ = queue_job(redis_client, "generate", GEN["spec"])
    assert legacy.owner is None
    assert client.get(f"/v1/jobs/{legacy.id}", headers=auth(WRITE_KEY)).status_code == 404
    assert client.get(f"/v1/jobs/{legacy.id}", headers=auth(ADMIN_KEY)).json()["owner"] is None


def test_with_auth_disabled_jobs_belong_to_anonymous(make_app, redis_client):
    with TestClient(make_app(api_keys=None, auth_disabled=True)) as anon:
        job = anon.post("/v1/jobs", json=GEN).json()
        assert job["owner"] == "anonymous"
        assert anon.get("/v1/jobs").json()["total"] == 1
