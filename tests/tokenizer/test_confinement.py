"""A tokenize job touches only the storage it may: inside the operator's roots, never through a symlink
out of them, never over another principal's dataset; the worker checks again whatever the API let in."""

from __future__ import annotations

import json
import os

from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import PLAN_KEY, queue_job
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.jobs.worker import Worker
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import open_store
from dfp_tokenizer.tasks import EncoderCache, TokenizeHandler

from .corpus import jsonl, records


def run_worker(r, roots: StorageRoots, endpoint_url: str | None = None) -> None:
    queue = TaskQueue(r, TOKENIZE.stream, lease_ms=5000)
    handler = TokenizeHandler(r, EncoderCache(endpoint_url), endpoint_url, roots)
    Worker(queue, JobStore(r), handler, block_ms=100).run(idle_exit_s=1.0)


def forged_job(r, spec: dict, owner: str | None = None) -> str:
    """A job written straight into Redis, as anyone who can write to Redis could: no API check ran."""
    jobs = JobStore(r)
    job, _ = jobs.create(TOKENIZE.name, spec, owner=owner)
    TaskQueue(r, TOKENIZE.stream).enqueue(job.id, PLAN_KEY, {"plan": True})
    return job.id


def test_inputs_outside_the_root_are_refused_before_any_io(redis_client, tmp_path, qwen3_tokenizer_dir,
                                                           s3_server, s3_bucket):
    root = tmp_path / "root"
    other = tmp_path / "other-team"
    other.mkdir()
    (other / "private.jsonl").write_bytes(jsonl(records(4, seed=1)))
    open_store(f"{s3_bucket}/private", endpoint_url=s3_server.endpoint_url).put("p.jsonl", jsonl(records(4, seed=2)))
    roots = StorageRoots([f"file://{root}", f"file://{qwen3_tokenizer_dir}"])
    ids = [forged_job(redis_client, {"input": f"file://{other}/", "output": f"file://{root}/a",
                                     "tokenizer": str(qwen3_tokenizer_dir)}),
           forged_job(redis_client, {"input": f"{s3_bucket}/private/", "output": f"file://{root}/b",
                                     "tokenizer": str(qwen3_tokenizer_dir)})]
    run_worker(redis_client, roots, s3_server.endpoint_url)
    for job_id in ids:
        rec = JobStore(redis_client).get(job_id)
        assert rec.state.value == "failed" and "outside the allowed storage" in rec.error, rec.error
        assert "spec.input" in rec.error
    assert not root.exists() or not any(root.rglob("*.safetensors"))


def test_a_symlinked_input_file_is_not_read(redis_client, tmp_path, qwen3_tokenizer_dir):
    root = tmp_path / "root"
    (root / "in").mkdir(parents=True)
    secret = tmp_path / "secret.jsonl"
    secret.write_bytes(jsonl(records(3, seed=5)))
    (root / "in" / "ok.jsonl").write_bytes(jsonl(records(5, seed=6)))
    os.symlink(secret, root / "in" / "leak.jsonl")
    roots = StorageRoots([f"file://{root}", f"file://{qwen3_tokenizer_dir}"])
    listed, _ = queue_job(redis_client, TOKENIZE.name, {"input": f"file://{root}/in/",
                                                        "output": f"file://{root}/out",
                                                        "tokenizer": str(qwen3_tokenizer_dir)}, roots=roots)
    run_worker(redis_client, roots)
    rec = JobStore(redis_client).get(listed.id)
    assert rec.state.value == "succeeded", rec.error
    assert rec.counters["files"] == 1 and rec.counters["samples"] == 5  # the link was not listed
    named = forged_job(redis_client, {"input": f"file://{root}/in/leak.jsonl", "output": f"file://{root}/out2",
                                      "tokenizer": str(qwen3_tokenizer_dir)})
    run_worker(redis_client, roots)
    rec = JobStore(redis_client).get(named)
    assert rec.state.value == "failed" and "outside the allowed storage" in rec.error


def test_a_forged_file_task_outside_the_input_is_refused(redis_client, tmp_path, qwen3_tokenizer_dir):
    root = tmp_path / "root"
    (root / "in").mkdir(parents=True)
    (root / "in" / "a.jsonl").write_bytes(jsonl(records(2, seed=7)))
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "x.jsonl").write_bytes(jsonl(records(2, seed=8)))
    roots = StorageRoots([f"file://{root}", f"file://{qwen3_tokenizer_dir}"])
    job, _ = queue_job(redis_client, TOKENIZE.name, {"input": f"file://{root}/in/", "output": f"file://{root}/out",
                                                     "tokenizer": str(qwen3_tokenizer_dir)}, roots=roots)
    TaskQueue(redis_client, TOKENIZE.stream).enqueue(job.id, "x.jsonl", {"file": f"file://{root}/elsewhere/x.jsonl",
                                                                         "rel": "x.jsonl", "name": "x"})
    run_worker(redis_client, roots)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "failed" and "task.file" in rec.error and "not under" in rec.error


def test_another_principals_dataset_is_never_overwritten(redis_client, tmp_path, qwen3_tokenizer_dir):
    root = tmp_path / "root"
    (root / "in").mkdir(parents=True)
    (root / "in" / "a.jsonl").write_bytes(jsonl(records(6, seed=9)))
    roots = StorageRoots([f"file://{root}", f"file://{qwen3_tokenizer_dir}"])
    spec = {"input": f"file://{root}/in/", "output": f"file://{root}/datasets/alice",
            "tokenizer": str(qwen3_tokenizer_dir)}
    alice, _ = queue_job(redis_client, TOKENIZE.name, spec, roots=roots, owner="alice")
    run_worker(redis_client, roots)
    assert JobStore(redis_client).get(alice.id).state.value == "succeeded"
    manifest = (root / "datasets" / "alice" / "manifest.json").read_bytes()

    (root / "in" / "a.jsonl").write_bytes(jsonl(records(2, seed=10)))
    bob, _ = queue_job(redis_client, TOKENIZE.name, spec, roots=roots, owner="bob")
    again, _ = queue_job(redis_client, TOKENIZE.name, spec, roots=roots, owner="alice")
    run_worker(redis_client, roots)
    rec = JobStore(redis_client).get(bob.id)
    assert rec.state.value == "failed" and "belongs to 'alice'" in rec.error
    assert JobStore(redis_client).get(again.id).state.value == "succeeded"  # its owner may rewrite it
    assert json.loads((root / "datasets" / "alice" / "manifest.json").read_bytes())["num_samples"] == 2
    assert manifest != (root / "datasets" / "alice" / "manifest.json").read_bytes()


def test_a_spec_without_output_gets_a_prefix_of_its_own(redis_client, tmp_path, qwen3_tokenizer_dir):
    root = tmp_path / "root"
    (root / "in").mkdir(parents=True)
    (root / "in" / "a.jsonl").write_bytes(jsonl(records(3, seed=11)))
    roots = StorageRoots([f"file://{root}", f"file://{qwen3_tokenizer_dir}"])
    job, _ = queue_job(redis_client, TOKENIZE.name, {"input": f"file://{root}/in/",
                                                     "tokenizer": str(qwen3_tokenizer_dir)},
                       roots=roots, owner="carol")
    assert job.spec["output"] == f"file://{root}/jobs/{job.id}/"
    run_worker(redis_client, roots)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "succeeded" and rec.outputs["dataset"].startswith(f"file://{root}/jobs/{job.id}")
    assert json.loads((root / "jobs" / job.id / ".dflash-owner.json").read_text())["owner"] == "carol"
