"""The evaluate job through the API: a drafter the project exported, measured on a tiny target by the
trainer workers beside n-gram speculation; bad lines counted, bounds and storage roots enforced."""

from __future__ import annotations

import json

import pytest
import torch
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.worker import Worker
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.models.stop_tokens import stop_token_ids
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.model import DFlashDrafter
from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id
from dfp_trainer.evaluate.decode import chat_prompt_ids
from dfp_trainer.export.zlab import export_drafter
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler

from tests.trainer.train_support import torch_threads

from .test_jobs import fields_of

BLOCK = 6


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_qwen3_dir):
    """A drafter for the tiny target, written by the project's exporter."""
    tok = load_tokenizer(tiny_qwen3_dir)
    parts = load_target_parts(tiny_qwen3_dir)
    cfg = DrafterConfig.for_target(parts.config, num_layers=1, block_size=BLOCK, mask_token_id=mask_token_id(tok))
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(cfg, parts.embed_tokens, parts.lm_head), tmp_path_factory.mktemp("drafter"))


def _worker(redis_server, redis_client) -> Worker:
    settings = TrainerSettings(redis_url=redis_server.url, device="cpu")
    return Worker(TaskQueue(redis_client, "train", lease_ms=settings.lease_ms), JobStore(redis_client),
                  TrainHandler(settings, redis_client), heartbeat_s=0.5)


def _spec(drafter_dir, tiny_qwen3_dir, prompts: list[str], output: str, **over) -> dict:
    return {"drafter": f"file://{drafter_dir}", "target": f"file://{tiny_qwen3_dir}", "prompts": prompts,
            "output": output, "max_new_tokens": 14, "enable_thinking": False, **over}


def test_evaluate_job_end_to_end_both_methods_equal_the_target_s_greedy_output(
        api, redis_server, redis_client, tmp_path, tiny_qwen3_dir, drafter_dir):
    first = tmp_path / "chat.jsonl"
    first.write_text("\n".join([
        json.dumps({"id": "a", "prompt": "Count from one to ten: one two three"}),
        "{not json",
        json.dumps({"messages": [{"role": "assistant", "content": "no user turn"}]}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "Repeat: red blue red blue red blue"}]}),
        json.dumps({"prompt": "beyond max_prompts"}),
    ]) + "\n")
    second = tmp_path / "set2"
    second.mkdir()
    (second / "p.jsonl").write_text(json.dumps({"prompt": "Name three rivers."}) + "\n")
    output = f"file://{tmp_path}/eval"
    spec = _spec(drafter_dir, tiny_qwen3_dir, [f"file://{first}", f"file://{second}"], output, max_prompts=2,
                 include_outputs=True)
    resp = api.post("/v1/jobs", json={"type": "evaluate", "spec": spec})
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    assert resp.json()["primary_unit"] == "prompts"

    with torch_threads(1):
        assert _worker(redis_server, redis_client).run(max_tasks=1, idle_exit_s=5) == 1
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "succeeded", job["error"]
    assert job["progress"]["units"]["prompts"]["done"] == 3 == job["progress"]["units"]["prompts"]["total"]
    assert job["counters"]["bad_lines"] == 2 and job["counters"]["skipped"] == 0
    assert job["outputs"]["report"] == output + "/evaluation.json"
    report = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert report["block_size"] == BLOCK and report["draft_length"] == BLOCK - 1

    chat, rivers = report["sets"]
    assert chat["evaluated"] == 2 and chat["bad_lines"] == 2 and rivers["evaluated"] == 1
    assert [(e["file"], e["line"]) for e in chat["errors"]] == [(f"file://{first}", 2), (f"file://{first}", 3)]
    assert "invalid JSON" in chat["errors"][0]["reason"] and "no user message" in chat["errors"][1]["reason"]
    assert [p["id"] for p in chat["per_prompt"]] == ["a", f"{first.name}:5"]

    tok = load_tokenizer(tiny_qwen3_dir)
    target = load_causal_lm(str(tiny_qwen3_dir), device="cpu")
    prompts = [[{"role": "user", "content": "Count from one to ten: one two three"}],
               [{"role": "user", "content": "Repeat: red blue red blue red blue"}],
               [{"role": "user", "content": "Name three rivers."}]]
    rows = chat["per_prompt"] + rivers["per_prompt"]
    with torch_threads(1), torch.no_grad():
        for messages, row in zip(prompts, rows):
            ids = torch.tensor(chat_prompt_ids(tok, messages, enable_thinking=False))
            greedy = target.generate(ids[None], max_new_tokens=14, do_sample=False, pad_token_id=0,
                                     eos_token_id=stop_token_ids(tok))[0, ids.shape[0]:].tolist()
            assert row["dflash_ids"] == greedy and row["ngram_ids"] == greedy and row["outputs_equal"]
            assert row["prompt_tokens"] == ids.shape[0]
    for pset in (chat, rivers):
        for method in ("dflash", "ngram"):
            fig = pset[method]
            assert sum(fig["accepted_hist"]) == fig["steps"] and len(fig["accepted_hist"]) == BLOCK
            assert len(fig["position_acceptance"]) == BLOCK - 1
            assert fig["tau"] == pytest.approx(fig["new_tokens"] / fig["steps"])
            assert fig["tau"] >= 1.0 and fig["tau_vllm"] >= 1.0 and fig["tokens_per_s"] > 0
        assert pset["dflash"]["drafting_steps"] == pset["dflash"]["steps"]  # DFlash drafts every step


def test_evaluate_spec_bounds_and_storage_roots_are_enforced(api, tmp_path, tiny_qwen3_dir, drafter_dir):
    prompts = f"file://{tmp_path}/p.jsonl"
    base = _spec(drafter_dir, tiny_qwen3_dir, [prompts], f"file://{tmp_path}/out")
    for field, value in [("max_new_tokens", 10 ** 6), ("max_prompts", 10 ** 9), ("ngram_max", 65),
                         ("max_prompt_tokens", 1 << 40), ("max_new_tokens", 0)]:
        resp = api.post("/v1/jobs", json={"type": "evaluate", "spec": {**base, field: value}})
        assert list(fields_of(resp)) == [f"spec.{field}"], field
    assert list(fields_of(api.post("/v1/jobs", json={"type": "evaluate", "spec": {**base, "prompts": [prompts] * 17}}))) \
        == ["spec.prompts"]
    assert list(fields_of(api.post("/v1/jobs", json={"type": "evaluate", "spec": {**base, "prompts": []}}))) \
        == ["spec.prompts"]
    reasons = fields_of(api.post("/v1/jobs", json={"type": "evaluate", "spec": {**base, "ngram_min": 5, "ngram_max": 2}}))
    assert "ngram_min (5) is above ngram_max (2)" in " ".join(reasons.values())
    outside = fields_of(api.post("/v1/jobs", json={"type": "evaluate", "spec": {
        **base, "prompts": [prompts, "file:///etc/prompts.jsonl"]}}))
    assert "outside the allowed storage" in outside["spec.prompts.1"]
    for field in ("drafter", "target", "output"):
        got = fields_of(api.post("/v1/jobs", json={"type": "evaluate", "spec": {**base, field: "file:///etc/x/"}}))
        assert "outside the allowed storage" in got[f"spec.{field}"], field
    dotted = fields_of(api.post("/v1/jobs", json={"type": "evaluate", "spec": {
        **base, "prompts": [f"file://{tmp_path}/../p.jsonl"]}}))
    assert list(dotted) == ["spec.prompts.0"]
    schema = api.get("/openapi.json").json()["components"]["schemas"]["EvaluateSpec"]["properties"]
    assert schema["prompts"]["maxItems"] == 16 and schema["max_new_tokens"]["maximum"] == 8192


def test_the_worker_refuses_a_prompt_set_outside_the_roots(redis_server, redis_client, tmp_path, tiny_qwen3_dir,
                                                           drafter_dir):
    # queued straight into Redis, past the API's check: the worker checks again before any I/O
    spec = _spec(drafter_dir, tiny_qwen3_dir, ["file:///etc/passwd.jsonl"], f"file://{tmp_path}/out")
    job, _ = queue_job(redis_client, "evaluate", spec)
    assert _worker(redis_server, redis_client).run(max_tasks=1, idle_exit_s=5) == 1
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.failed and "spec.prompts.0" in rec.error and "outside" in rec.error
    assert not (tmp_path / "out").exists()
