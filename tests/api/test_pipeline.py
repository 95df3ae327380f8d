"""Pipeline jobs through HTTP: stages start in order, feed each other, and failures/cancels propagate.

The generate and train stages are driven through ``finish_job`` (as their workers do); the
tokenize stage is run by a real tokenize worker on the completions the generate stage "wrote".
"""

from __future__ import annotations

import time

from dfp_shared.jobs import JobState, JobStore
from dfp_shared.submit import finish_job

from .sse import read_events
from .tokenize_worker import start_worker, write_completions


def _pipeline_spec(tmp_path, tokenizer_dir) -> dict:
    return {"generate": {"prompts": (tmp_path / "prompts.jsonl").as_uri(), "output": (tmp_path / "gen").as_uri(),
                         "model": "/models/tiny"},
            "tokenize": {"output": (tmp_path / "tokens").as_uri(), "tokenizer": str(tokenizer_dir)},
            "train": {"target": "/models/tiny", "output": (tmp_path / "drafter").as_uri()}}


def _stage_job(api, pipeline_id: str, stage: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outputs = api.get(f"/v1/jobs/{pipeline_id}").json()["outputs"]
        if f"{stage}_job" in outputs:
            return api.get(f"/v1/jobs/{outputs[f'{stage}_job']}").json()
        time.sleep(0.05)
    raise AssertionError(f"stage {stage} never started")


def test_stages_run_in_order_and_a_failed_stage_fails_the_pipeline(api, redis_client, encoders,
                                                                   qwen3_tokenizer_dir, tmp_path):
    spec = _pipeline_spec(tmp_path, qwen3_tokenizer_dir)
    pipeline = api.post("/v1/jobs", json={"type": "pipeline", "spec": spec}).json()
    pid = pipeline["id"]
    gen = _stage_job(api, pid, "generate")
    assert gen["parent_id"] == pid and gen["stage"] == "generate" and gen["spec"]["output"] == spec["generate"]["output"]
    assert set(api.get(f"/v1/jobs/{pid}").json()["outputs"]) == {"generate_job"}  # nothing else started yet

    # the generate stage "writes" its completions and finishes
    completions = write_completions(tmp_path / "gen" / "completions", files=2, per_file=3)
    JobStore(redis_client).start(gen["id"])
    finish_job(redis_client, gen["id"], JobState.succeeded, outputs={"completions": completions})

    tok = _stage_job(api, pid, "tokenize")
    assert tok["spec"]["input"] == completions and tok["spec"]["output"] == spec["tokenize"]["output"]
    assert "train_job" not in api.get(f"/v1/jobs/{pid}").json()["outputs"]
    worker, thread = start_worker(redis_client, encoders)
    try:
        train = _stage_job(api, pid, "train")
    finally:
        worker.stopping.set()
        thread.join(10)
    assert api.get(f"/v1/jobs/{tok['id']}").json()["state"] == "succeeded"
    assert train["spec"]["dataset"] == spec["tokenize"]["output"] and train["state"] == "queued"
    assert api.get(f"/v1/jobs/{pid}").json()["counters"]["stages"] == 2

    JobStore(redis_client).start(train["id"])
    finish_job(redis_client, train["id"], JobState.failed, error="RuntimeError: loss is NaN at step 3")

    events = read_events(api, pid)
    stages = [d["stage"] for e, _, d in events if e == "stage"]
    assert stages == ["generate", "tokenize", "train"]
    stage_progress = [d["stage"] for e, _, d in events if e == "progress" and "stage" in d]
    assert stage_progress[-1]["name"] == "train" and stage_progress[-1]["state"] == "failed"
    end = events[-1][2]
    assert end["state"] == "failed" and "stage train" in end["error"] and "loss is NaN at step 3" in end["error"]
    job = api.get(f"/v1/jobs/{pid}").json()
    assert job["state"] == "failed" and job["error"] == end["error"]
    assert job["progress"]["units"]["stages"] == {"done": 2, "total": 3, "fraction": 2 / 3,
                                                  "rate_per_s": job["progress"]["units"]["stages"]["rate_per_s"]}


def test_cancelling_a_pipeline_cancels_its_running_stage(api, redis_client, qwen3_tokenizer_dir, tmp_path):
    pid = api.post("/v1/jobs", json={"type": "pipeline", "spec": _pipeline_spec(tmp_path, qwen3_tokenizer_dir)}).json()["id"]
    gen = _stage_job(api, pid, "generate")
    JobStore(redis_client).start(gen["id"])
    resp = api.post(f"/v1/jobs/{pid}/cancel")
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled"
    assert api.get(f"/v1/jobs/{gen['id']}").json()["state"] == "cancelled"
    assert JobStore(redis_client).is_cancelled(gen["id"])  # its workers stop taking its tasks
    # a late success of the cancelled stage starts nothing
    finish_job(redis_client, gen["id"], JobState.succeeded, outputs={"completions": "file:///x"})
    assert set(api.get(f"/v1/jobs/{pid}").json()["outputs"]) == {"generate_job"}


def test_cancelling_a_stage_ends_its_pipeline(api, redis_client, qwen3_tokenizer_dir, tmp_path):
    pid = api.post("/v1/jobs", json={"type": "pipeline", "spec": _pipeline_spec(tmp_path, qwen3_tokenizer_dir)}).json()["id"]
    gen = _stage_job(api, pid, "generate")
    assert api.post(f"/v1/jobs/{gen['id']}/cancel").json()["state"] == "cancelled"
    job = api.get(f"/v1/jobs/{pid}").json()
    assert job["state"] == "cancelled" and "stage generate" in job["error"]
