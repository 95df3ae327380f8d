"""The adaptation loop through the API and the services' real workers, on a tiny target: captured traffic in,
a candidate trained, evaluated on the newest traffic and promoted or refused by the rule, with the evidence.

The first run has nothing served: its candidate is judged against n-gram speculation, under a threshold no
drafter can pass, and refused. The operator then serves an untrained drafter (version 1); the second run, an hour
later, has its sampled records answered again by the target, trains warm-started from version 1, is evaluated
beside it on the same held-out prompts, and is promoted by the rule on the two evaluations' per-prompt τ; it is
then rolled back to version 1, byte for byte.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone

import pytest
from dfp_adapt.rule import decide, paired
from dfp_adapt.run import JobsApi, adapt_once
from dfp_adapt.served_store import ServedDrafters
from dfp_adapt.serving import StepCosts
from dfp_adapt.settings import AdaptSettings
from dfp_generation.settings import GenerationSettings
from dfp_generation.tasks import GenerationHandler, GenerationWorker
from dfp_shared.api_client import Api
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.worker import Worker
from dfp_shared.records.completions import completion_record, encode_records
from dfp_shared.storage.ownership import OutputClaims, OutputOwned
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import open_store
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler

from tests.shared.test_promotion import current_files
from tests.trainer.train_support import tiny_spec, torch_threads

from .conftest import WRITE_KEY, served
from .tokenize_worker import start_worker

NOW = datetime(2026, 3, 1, 12, 30, tzinfo=timezone.utc)
# n-gram made dear and the drafter's forward nearly free: the candidate drafter against the served one decides
COSTS = StepCosts(target_step_s=1.0, draft_step_s=1e-9, ngram_step_s=60.0)
TOPICS = ["rivers", "colours", "numbers", "planets", "trees", "birds", "metals", "seas", "stars", "cities", "fruit",
          "stones"]


def write_traffic(capture: str) -> None:
    """Three hours of captured traffic: greedy and sampled records, one the client left mid-stream each hour; the
    newest hour (after the first run) only sampled ones."""
    store = open_store(capture)
    for hour in (2, 1, -1):
        rows = []
        for i, topic in enumerate(TOPICS):
            at = NOW - timedelta(hours=hour, minutes=30 - 2 * i)
            meta = {"source": "capture", "captured_at": at.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "greedy": hour > 0 and i % 3 != 0, "incomplete": i == 5, "model": "tiny"}
            rows.append(completion_record(f"h{hour}-{i}", [{"role": "user", "content": f"Name three {topic}."}],
                                          f"Three {topic}: one, two and three.", None, meta))
        store.put(f"completions/{(NOW - timedelta(hours=hour)):%Y%m%dT%H}/w0-b-000001.jsonl", encode_records(rows))


def untrained_export(tiny_qwen3_dir, stage_specs: dict, out) -> str:
    """A drafter the runs' train spec builds, untrained, exported as a train job exports it."""
    import torch
    from dfp_shared.models.tokenizer_assets import load_tokenizer
    from dfp_trainer.drafter.model import DFlashDrafter
    from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id
    from dfp_trainer.export.zlab import export_drafter

    from tests.trainer.train_support import run_config

    parts = load_target_parts(tiny_qwen3_dir)
    spec = {**stage_specs["train"], "dataset": "file:///unused", "output": "file:///unused"}
    cfg = run_config(spec).drafter_config(parts.config, mask_token_id(load_tokenizer(tiny_qwen3_dir)))
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(cfg, parts.embed_tokens, parts.lm_head), out).as_uri() + "/"


def stages(tiny_qwen3_dir) -> dict:
    # AdamW: the step count and rate below are tuned for it, so that 30 steps lift the candidate past the threshold
    train = tiny_spec("unused", tiny_qwen3_dir, "unused", steps=4, optimizer="adamw")
    del train["dataset"], train["output"]
    return {"generate": {"model": str(tiny_qwen3_dir), "max_new_tokens": 8, "shard_size": 4},
            "tokenize": {"tokenizer": str(tiny_qwen3_dir), "max_length": 64, "truncation": "truncate"},
            "train": train,
            "evaluate": {"target": str(tiny_qwen3_dir), "max_new_tokens": 8, "batch_size": 4}}


@pytest.fixture
def workers(redis_server, redis_client, encoders):
    """The generation, tokenizer and trainer workers, each in a thread, as their services run them."""
    tokenizer, tokenizer_thread = start_worker(redis_client, encoders)
    generation = GenerationWorker(GenerationHandler(redis_client, GenerationSettings(redis_url=redis_server.url)),
                                  block_ms=200)
    trainer = Worker(TaskQueue(redis_client, "train"), JobStore(redis_client),
                     TrainHandler(TrainerSettings(redis_url=redis_server.url, device="cpu"), redis_client), block_ms=200)
    threads = [tokenizer_thread] + [threading.Thread(target=w.run, daemon=True) for w in (generation, trainer)]
    for t in threads[1:]:
        t.start()
    with torch_threads(1):
        yield
    for w in (tokenizer, generation, trainer):
        w.stopping.set()
    for t in threads:
        t.join(30)


def report_tau(report_uri: str) -> tuple[dict, dict]:
    rows = json.loads(open(report_uri.removeprefix("file://")).read())["sets"][0]["per_prompt"]
    return {r["id"]: r["tau_dflash"] for r in rows}, {r["id"]: r["tau_ngram"] for r in rows}


@pytest.mark.timeout(600)
def test_traffic_to_a_refused_then_a_judged_candidate(make_app, redis_client, workers, tiny_qwen3_dir, tmp_path):
    root = f"file://{tmp_path}/store"
    write_traffic(f"{root}/capture")
    specs = stages(tiny_qwen3_dir)
    with served(make_app()) as port:
        jobs = JobsApi(Api(f"http://127.0.0.1:{port}", WRITE_KEY), poll_s=0.2, timeout_s=300)
        base = dict(storage_url=root, adapt_name="tiny", adapt_window_hours=3, adapt_heldout_share=0.2)

        first = adapt_once(jobs, AdaptSettings(**base, adapt_min_gain=10.0, adapt_min_prompts=2), specs, now=NOW)
        assert first["action"] == "refused" and first["served"] == {"method": "none"} and first["warm_start"] is None
        assert all("not above the threshold" in c["reason"] for c in first["candidates"][1:])
        assert first["source"]["dropped"]["incomplete"] == 2 and first["source"]["heldout_records"] == 4
        assert first["source"]["greedy"] > 0 and first["source"]["sampled"] > 0
        regenerated = open_store(first["run"] + "generated/completions/")
        assert [k for k in regenerated.list("") if k.endswith(".jsonl")]  # the sampled ones, answered again
        served_store = ServedDrafters(f"{root}/served", "tiny")
        assert served_store.current_version() is None and served_store.current() is None
        # the run claimed the served store for its key: another principal's job cannot write what serving reads
        claims = OutputClaims(StorageRoots.from_settings(AdaptSettings(**base)))
        with pytest.raises(OutputOwned, match="belongs to 'writer'"):
            claims.claim(served_store.version_uri(1), "reader", "job-of-another-key")

        served_store.promote(untrained_export(tiny_qwen3_dir, specs, tmp_path / "untrained"), {"by": "operator"})
        version1 = current_files(served_store)
        specs["train"].update(steps=30, lr=1e-2)
        second = adapt_once(jobs, AdaptSettings(**{**base, "adapt_window_hours": 1.0, "adapt_heldout_share": 0.3},
                                                adapt_min_gain=0.01, adapt_alpha=0.25, adapt_min_prompts=2,
                                                adapt_step_costs=COSTS), specs, now=NOW + timedelta(hours=1))
    assert second["served"] == {"method": "dflash", "version": 1} and second["warm_start"] == 1
    assert second["source"]["greedy"] == 0 and second["source"]["sampled"] == 8
    pipeline = api_job(redis_client, second["source_job"])
    train = api_job(redis_client, pipeline.outputs["train_job"])
    assert train.spec["init_from"] == served_store.version_uri(1)  # warm-started from what was served
    cand, _ = report_tau(second["run"] + "eval-candidate/evaluation.json")
    base_tau, _ = report_tau(second["run"] + "eval-served/evaluation.json")
    assert set(cand) == set(base_tau) == {"h-1-9", "h-1-10", "h-1-11"}  # the newest traffic, held out
    # trained on the target's own answers, the candidate drafts better than the untrained version it started from
    assert all(cand[i] >= base_tau[i] for i in cand) and sum(cand.values()) > sum(base_tau.values())
    step = COSTS.target_step_s + COSTS.draft_step_s  # the same step for both drafters: tokens/s is τ / step
    speed = {k: v / step for k, v in cand.items()}, {k: v / step for k, v in base_tau.items()}
    expected = decide(*paired(*speed), threshold=0.01 * sum(speed[1].values()) / 3, alpha=0.25, min_prompts=2)
    assert expected.promote and second["action"] == "promoted" and second["version"] == 2
    row = next(c for c in second["candidates"] if c["name"] == "candidate")
    assert row["gain"] == pytest.approx(expected.mean_difference)
    assert row["standard_error"] == pytest.approx(expected.standard_error)
    # three held-out prompts are little evidence: the default level (t quantile 4.30) would refuse the same gain
    assert not decide(*paired(*speed), threshold=0.0, alpha=0.025, min_prompts=2).promote
    history = served_store.history()
    assert [e["action"] for e in history["events"]] == ["refused", "promoted", "promoted"]
    assert history["stack"] == [1, 2]
    candidate = open_store(pipeline.outputs["drafter"])
    assert current_files(served_store) == {k: candidate.get(k) for k in candidate.list("")}
    served_store.rollback("back to version 1")
    assert current_files(served_store) == version1 and served_store.current().version == 1


def api_job(r, job_id: str):
    return JobStore(r).get(job_id)
