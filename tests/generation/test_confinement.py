"""A generate job reads prompts and writes completions only inside the operator's roots, whatever Redis says."""

from __future__ import annotations

from dfp_generation.settings import GenerationSettings
from dfp_generation.tasks import GenerationHandler, GenerationWorker
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import PLAN_KEY
from dfp_shared.jobs.types import GENERATE

from .conftest import write_jsonl


def test_forged_jobs_outside_the_root_are_refused_before_any_io(redis_server, redis_client, tmp_path):
    root, other = tmp_path / "root", tmp_path / "other"
    write_jsonl(other / "private.jsonl", [{"id": "p1", "prompt": "secret"}])
    settings = GenerationSettings(redis_url=redis_server.url, storage_url=f"file://{root}", allowed_prefixes="")
    jobs = JobStore(redis_client)
    specs = {
        "prompts": {"prompts": f"file://{other}/private.jsonl", "output": f"file://{root}/out", "engine": "openai",
                    "openai_model": "m"},
        "output": {"prompts": f"file://{root}/p.jsonl", "output": f"file://{other}/out", "engine": "openai",
                   "openai_model": "m"},
    }
    ids = {}
    for field, spec in specs.items():  # written straight into Redis: no API check ran
        job, _ = jobs.create(GENERATE.name, spec, owner="mallory")
        TaskQueue(redis_client, GENERATE.stream).enqueue(job.id, PLAN_KEY, {"plan": True})
        ids[field] = job.id
    GenerationWorker(GenerationHandler(redis_client, settings), block_ms=200).run(idle_exit_s=1.5)
    for field, job_id in ids.items():
        rec = jobs.get(job_id)
        assert rec.state == JobState.failed, rec
        assert f"spec.{field}" in rec.error and "outside the allowed storage" in rec.error
    assert not (other / "out").exists()
