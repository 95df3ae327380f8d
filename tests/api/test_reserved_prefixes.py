"""Prefixes the operator keeps for one principal's jobs (the served drafters and the adaptation runs, kept for the
loop's key) or for none (the captured traffic): another key's job can neither write there, which would pre-claim
the loop's prefixes and stop it or put a drafter where serving reads, nor read there, which would hand it every
team's captured prompts; the API answers 422 naming the field, and a worker refuses such a job again."""

from __future__ import annotations

import hashlib
import json

import pytest
from dfp_shared.config import CommonSettings, ConfigError, load_settings
from dfp_shared.storage_roots import OutsideRoots, StorageRoots
from fastapi.testclient import TestClient

from .conftest import WRITE_KEY, auth

LOOP_KEY = "dfp_test-adapt-loop-key-0123456789"
ADMIN_KEY = "dfp_test-admin-key-0123456789"
RESERVED = {"s3://bucket/served": "adapt", "s3://bucket/adapt": "adapt", "s3://bucket/capture": ""}
MODEL = "file:///models/tiny"


def entries() -> str:
    def entry(name, key, scopes):
        return {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest(), "scopes": scopes}

    return json.dumps([entry("writer", WRITE_KEY, ["read", "write"]), entry("adapt", LOOP_KEY, ["read", "write"]),
                       entry("root", ADMIN_KEY, ["admin"])])


@pytest.fixture
def client(make_app, redis_client):
    with TestClient(make_app(api_keys=entries(), reserved_prefixes=json.dumps(RESERVED))) as c:
        yield c


def submit(client, key: str, job_type: str, spec: dict):
    return client.post("/v1/jobs", json={"type": job_type, "spec": spec}, headers=auth(key))


def refusal(resp) -> str:
    assert resp.status_code == 422, resp.text
    return json.dumps(resp.json())


@pytest.mark.parametrize("key", [WRITE_KEY, ADMIN_KEY])
def test_another_key_cannot_write_where_serving_reads_or_pre_claim_the_loop_s_runs(client, key):
    for output in ("s3://bucket/served/default/current/", "s3://bucket/served/", "s3://bucket/adapt/default/x/"):
        body = refusal(submit(client, key, "generate", {"prompts": "s3://bucket/p.jsonl", "model": MODEL,
                                                         "output": output}))
        assert "output" in body and "kept for the jobs of 'adapt'" in body
    # a prefix that holds a reserved one: claiming it would put the loop's prefixes below another principal's
    body = refusal(submit(client, key, "generate", {"prompts": "s3://bucket/p.jsonl", "model": MODEL,
                                                     "output": "s3://bucket/"}))
    assert "s3://bucket/served" in body


def test_another_key_cannot_read_the_captured_traffic_or_the_served_drafter(client):
    spec = {"input": "s3://bucket/capture/2026120703/", "tokenizer": MODEL, "output": "s3://bucket/mine/"}
    body = refusal(submit(client, WRITE_KEY, "tokenize", spec))
    assert "input" in body and "no job may read or write" in body
    body = refusal(submit(client, WRITE_KEY, "tokenize", {**spec, "input": "s3://bucket/"}))  # lists all below it
    assert "input" in body and "is or holds" in body
    body = refusal(submit(client, WRITE_KEY, "pipeline", {
        "tokenize": {"input": "s3://bucket/data/", "tokenizer": MODEL},
        "train": {"target": MODEL, "init_from": "s3://bucket/served/default/current/"}}))
    assert "train" in body and "init_from" in body


def test_the_loop_s_key_writes_and_reads_its_own_prefixes_but_not_the_capture(client):
    made = submit(client, LOOP_KEY, "pipeline", {
        "tokenize": {"input": "s3://bucket/adapt/default/20261207T030000/data/", "tokenizer": MODEL,
                     "output": "s3://bucket/adapt/default/20261207T030000/tokens/"},
        "train": {"target": MODEL, "init_from": "s3://bucket/served/default/current/",
                  "output": "s3://bucket/adapt/default/20261207T030000/train/"}})
    assert made.status_code == 201, made.text
    refusal(submit(client, LOOP_KEY, "tokenize", {"input": "s3://bucket/capture/", "tokenizer": MODEL,
                                                  "output": "s3://bucket/adapt/default/t/"}))
    # other prefixes stay every key's, as before
    assert submit(client, WRITE_KEY, "generate", {"prompts": "s3://bucket/p.jsonl", "model": MODEL,
                                                  "output": "s3://bucket/served-elsewhere/"}).status_code == 201


def test_a_worker_refuses_a_job_written_into_redis_with_another_owner(tmp_path):
    roots = StorageRoots([f"file://{tmp_path}"], reserved={f"file://{tmp_path}/served": "adapt"})
    spec = {"input": f"file://{tmp_path}/data/", "tokenizer": MODEL, "output": f"file://{tmp_path}/served/x/"}
    with pytest.raises(OutsideRoots, match=r"spec\.output: .* kept for the jobs of 'adapt'"):
        roots.check_reservations("tokenize", spec, owner="mallory")
    with pytest.raises(OutsideRoots, match="kept for the jobs of 'adapt'"):
        roots.check_reservations("tokenize", spec, owner=None)  # ownerless: the anonymous principal
    roots.check_reservations("tokenize", spec, owner="adapt")
    # a symlink inside the roots that points into the reserved prefix is no way around it
    (tmp_path / "served").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "served")
    with pytest.raises(OutsideRoots, match="kept for the jobs of 'adapt'"):
        roots.check_reservations("tokenize", {**spec, "output": f"file://{tmp_path}/link/x/"}, owner="mallory")


@pytest.mark.parametrize("value, reason", [
    ("not json", "JSON object"), ('["s3://bucket/served"]', "JSON object"),
    ('{"s3://bucket/served": 7}', "principal"), ('{"s3://bucket/served": "no spaces"}', "principal"),
    ('{"s3://bucket/../served": "adapt"}', "s3://bucket/../served"),
])
def test_a_bad_reservation_is_refused_at_start_naming_the_variable(monkeypatch, value, reason):
    monkeypatch.setenv("DFLASH_RESERVED_PREFIXES", value)
    with pytest.raises(ConfigError, match=rf"DFLASH_RESERVED_PREFIXES: .*{reason}"):
        load_settings(CommonSettings)
