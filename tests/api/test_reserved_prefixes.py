"""Prefixes the operator keeps for one principal's jobs (the served drafters and the adaptation runs, kept for the
loop's key) or for none (the captured traffic): another key's job can neither write there, which would pre-claim
the loop's prefixes and stop it or put a drafter where serving reads, nor read there, which would hand it every
team's captured prompts; the API answers 422 naming the field, and a worker refuses such a job again."""

from __future__ import annotations

import hashlib
import json

import pytest
from dfp_shared.config import CommonSettings, ConfigError, load_settings
from dfp_shared.storage.roots import OutsideRoots, StorageRoots
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


# --- what a task carries: it may come from anyone who can write to Redis ---------------------------------------

@pytest.fixture
def capture_layout(tmp_path):
    root = tmp_path / "root"
    hour = root / "capture" / "completions" / "2026120703"
    hour.mkdir(parents=True)
    (hour / "w.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "another team's prompt"}]}) + "\n")
    (root / "mine").mkdir()
    (root / "mine" / "p.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "mine"}]}) + "\n")
    return root, StorageRoots([f"file://{root}"], reserved={f"file://{root}/capture": ""})


def test_a_generate_shard_reads_only_the_spec_s_prompts_not_the_reserved_traffic(capture_layout):
    from dfp_generation.tasks import GenerationHandler
    from dfp_shared.jobs.queue import Task
    from dfp_shared.specs.generate import GenerateSpec

    root, roots = capture_layout
    handler = GenerationHandler.__new__(GenerationHandler)
    handler.roots = roots
    for prompts in (f"file://{root}/p.jsonl", f"file://{root}/mine/"):
        spec = GenerateSpec.model_validate({"prompts": prompts, "model": MODEL, "output": f"file://{root}/out/"})
        for shard_root, file in ((f"file://{root}", "capture/completions/2026120703/w.jsonl"),
                                 (f"file://{root}/capture", "completions/2026120703/w.jsonl")):
            task = Task(id="1-0", job_id="j", key="shard-00000", payload={
                "prompts_root": shard_root, "index": 0, "prompts": 1, "segments": [{"file": file, "start": 1, "end": 2}]})
            with pytest.raises(OutsideRoots):
                handler.confine_task(task, spec, "mallory")
    spec = GenerateSpec.model_validate({"prompts": f"file://{root}/mine/p.jsonl", "model": MODEL,
                                        "output": f"file://{root}/out/"})
    handler.confine_task(Task(id="1-0", job_id="j", key="shard-00000", payload={  # what the planner writes
        "prompts_root": f"file://{root}/mine", "index": 0, "prompts": 1,
        "segments": [{"file": "p.jsonl", "start": 1, "end": 2}]}), spec, "mallory")


def test_a_task_s_file_through_a_symlink_is_checked_where_it_leads(capture_layout):
    root, roots = capture_layout
    (root / "mine" / "lnk").symlink_to(root / "capture")
    uri = f"file://{root}/mine/lnk/completions/2026120703/w.jsonl"
    with pytest.raises(OutsideRoots, match="no job may read"):
        roots.check_reserved(uri, "mallory", "task.file")
    (root / "elsewhere").mkdir()
    (root / "mine" / "out").symlink_to(root / "elsewhere")
    with pytest.raises(OutsideRoots, match="not under"):
        roots.check_inside(f"file://{root}/mine/out/x.jsonl", f"file://{root}/mine/", "task.file")


def test_a_trainer_group_member_checks_the_reservations_of_a_published_run(capture_layout, redis_client):
    from dfp_shared.jobs.store import JobStore
    from dfp_trainer.jobs.launch import _allowed

    root, roots = capture_layout
    spec = {"dataset": f"file://{root}/capture/completions/", "target": f"file://{root}/models/m",
            "output": f"file://{root}/mine/t/"}
    job = JobStore(redis_client).create("train", spec, owner="mallory")[0]
    assert _allowed(roots, {"run_id": "r1", "job_id": job.id, "spec": json.dumps(spec)}, redis_client) is False
    assert _allowed(roots, {"run_id": "r2", "job_id": "no-such-job", "spec": json.dumps(spec)}, redis_client) is False
    # a run outside the roots is refused too, not raised out of the member's loop
    outside = {**spec, "dataset": "file:///etc/"}
    assert _allowed(roots, {"run_id": "r3", "job_id": job.id, "spec": json.dumps(outside)}, redis_client) is False
    mine = {**spec, "dataset": f"file://{root}/mine/tokens/"}
    assert _allowed(roots, {"run_id": "r4", "job_id": job.id, "spec": json.dumps(mine)}, redis_client) is True
