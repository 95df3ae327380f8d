"""Pipeline jobs through HTTP: stages start in order, feed each other, and failures/cancels propagate.

The first test runs every stage on the services' real workers (a tiny target generates, the
tokenizer tokenizes, the trainer rejects a spec it cannot run). The others drive stages through
``finish_job`` (as their workers do) to reach states a real run reaches only by chance.
"""

from __future__ import annotations

import json
import threading
import time

from dfp_generation.settings import GenerationSettings
from dfp_generation.tasks import GenerationHandler, GenerationWorker
from dfp_shared.jobs.flow import finish_job
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.worker import Worker
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler

from tests.trainer.train_support import tiny_spec

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


def _worker_thread(worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


def test_real_workers_run_the_stages_in_order_and_the_trainer_s_error_fails_the_pipeline(
        api, redis_server, redis_client, encoders, tiny_qwen3_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Count to {i}."}]})
                               + "\n" for i in range(3)))
    spec = {"generate": {"prompts": prompts.as_uri(), "output": (tmp_path / "gen").as_uri(), "model": str(tiny_qwen3_dir),
                         "max_new_tokens": 8, "shard_size": 2, "temperature": 0.0},
            "tokenize": {"output": (tmp_path / "tokens").as_uri(), "tokenizer": str(tiny_qwen3_dir)},
            # the tiny target has 8 layers: the trainer finds layer 99 missing when it loads the target
            "train": tiny_spec("file:///unused", tiny_qwen3_dir, (tmp_path / "drafter").as_uri(),
                               num_draft_layers=2, target_layer_ids=[1, 99])}
    del spec["train"]["dataset"]  # the pipeline fills it in from the tokenize stage
    pid = api.post("/v1/jobs", json={"type": "pipeline", "spec": spec}).json()["id"]

    tokenizer, tokenizer_thread = start_worker(redis_client, encoders)
    generation = GenerationWorker(GenerationHandler(redis_client, GenerationSettings(redis_url=redis_server.url)),
                                  block_ms=200)
    trainer = Worker(TaskQueue(redis_client, "train"), JobStore(redis_client),
                     TrainHandler(TrainerSettings(redis_url=redis_server.url, device="cpu"), redis_client), block_ms=200)
    job = _run_until_done(api, pid, [generation, tokenizer, trainer],
                          [_worker_thread(generation), tokenizer_thread, _worker_thread(trainer)])
    stages = {s: api.get(f"/v1/jobs/{job['outputs'][f'{s}_job']}").json() for s in ("generate", "tokenize", "train")}
    assert stages["generate"]["state"] == stages["tokenize"]["state"] == "succeeded"
    assert stages["tokenize"]["counters"]["samples"] == 3  # every completion the generate stage wrote
    assert stages["train"]["spec"]["dataset"] == spec["tokenize"]["output"]
    train_error = stages["train"]["error"]
    assert stages["train"]["state"] == "failed" and "target_layer_ids [99] do not exist" in train_error
    assert job["state"] == "failed" and "stage train" in job["error"] and train_error in job["error"]
    events = read_events(api, pid)
    assert [d["stage"] for e, _, d in events if e == "stage"] == ["generate", "tokenize", "train"]


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


def test_a_pipeline_without_generate_trains_on_the_prompt_set_s_own_answers(
        api, redis_server, redis_client, encoders, tiny_qwen3_dir, tmp_path):
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"id": f"a{i}", "messages": [
        {"role": "user", "content": f"What is {i} times three?"},
        {"role": "assistant", "content": f"{i} times three is {3 * i}, since three lots of {i} make {3 * i}."}]}) + "\n"
        for i in range(4)))
    spec = {"tokenize": {"input": answers.as_uri(), "output": (tmp_path / "tokens").as_uri(),
                         "tokenizer": str(tiny_qwen3_dir)},
            "train": tiny_spec("file:///unused", tiny_qwen3_dir, (tmp_path / "drafter").as_uri(), steps=2)}
    del spec["train"]["dataset"]
    pipeline = api.post("/v1/jobs", json={"type": "pipeline", "spec": spec}).json()
    pid = pipeline["id"]
    assert pipeline["totals"] == {"stages": 2}

    tokenizer, tokenizer_thread = start_worker(redis_client, encoders)
    trainer = Worker(TaskQueue(redis_client, "train"), JobStore(redis_client),
                     TrainHandler(TrainerSettings(redis_url=redis_server.url, device="cpu"), redis_client), block_ms=200)
    job = _run_until_done(api, pid, [tokenizer, trainer], [tokenizer_thread, _worker_thread(trainer)])
    assert "generate_job" not in job["outputs"]
    stages = {s: api.get(f"/v1/jobs/{job['outputs'][f'{s}_job']}").json() for s in ("tokenize", "train")}
    assert job["state"] == stages["train"]["state"] == "succeeded", job
    tokenized = stages["tokenize"]["counters"]
    assert tokenized["samples"] == 4 and 0 < tokenized["trained_tokens"] < tokenized["tokens"]  # the answers only
    assert stages["train"]["spec"]["dataset"] == spec["tokenize"]["output"]
    assert job["counters"]["stages"] == 2
    assert [d["stage"] for e, _, d in read_events(api, pid) if e == "stage"] == ["tokenize", "train"]


def test_a_pipeline_without_generate_needs_tokenize_s_input_inside_the_roots(api, tmp_path):
    spec = _pipeline_spec(tmp_path, "/models/tokenizer")
    del spec["generate"]
    missing = api.post("/v1/jobs", json={"type": "pipeline", "spec": spec})
    assert missing.status_code == 422
    fields = {f["field"]: f["reason"] for f in missing.json()["fields"]}
    assert set(fields) == {"spec.tokenize.input"} and "without a generate stage" in fields["spec.tokenize.input"]
    spec["tokenize"]["input"] = "file:///etc/answers.jsonl"
    outside = api.post("/v1/jobs", json={"type": "pipeline", "spec": spec})
    assert outside.status_code == 422
    fields = {f["field"]: f["reason"] for f in outside.json()["fields"]}
    assert set(fields) == {"spec.tokenize.input"} and "outside the allowed storage" in fields["spec.tokenize.input"]


def _run_until_done(api, pid: str, workers: list, threads: list, timeout_s: float = 240) -> dict:
    """Wait (bounded) until the pipeline ``pid`` ends, stop the workers and their threads; the job's record."""
    try:
        deadline = time.monotonic() + timeout_s
        while api.get(f"/v1/jobs/{pid}").json()["state"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, api.get(f"/v1/jobs/{pid}").json()
            time.sleep(0.2)
    finally:
        for w in workers:
            w.stopping.set()
        for t in threads:
            t.join(30)
    return api.get(f"/v1/jobs/{pid}").json()
