"""The thinking mode of a train job is checked against the one the dataset was tokenized in (recorded
in the manifest by the tokenize job); manifests without it still load."""

from __future__ import annotations

import json

import pytest
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.types import TOKENIZE
from dfp_shared.jobs.worker import Worker
from dfp_shared.records.token_shards import load_dataset
from dfp_shared.specs.train import TrainSpec
from dfp_tokenizer.tasks import EncoderCache, TokenizeHandler
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.loop.prepare import TrainError, prepare

from tests.trainer.data_support import TOPICS
from tests.trainer.train_support import run_config, tiny_spec, torch_threads


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def _tokenize(redis_client, tmp_path, tokenizer_dir, thinking: bool) -> str:
    """A real tokenize job over a few completion records; returns the dataset prefix."""
    inp, out = tmp_path / "in", tmp_path / f"tokens-{thinking}"
    inp.mkdir(exist_ok=True)
    lines = [json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Tell me about {topic}."},
        {"role": "assistant", "content": f"{topic.capitalize()} are interesting in many ways, fact {i}.",
         "reasoning_content": f"The user asks about {topic}; answer briefly."}]}) for i, topic in enumerate(TOPICS)]
    (inp / "part.jsonl").write_text("\n".join(lines) + "\n")
    job, _ = queue_job(redis_client, "tokenize", {"input": str(inp), "output": str(out),
                                                  "tokenizer": str(tokenizer_dir), "thinking": thinking})
    Worker(TaskQueue(redis_client, TOKENIZE.stream, lease_ms=5000), JobStore(redis_client),
           TokenizeHandler(redis_client, EncoderCache()), block_ms=100).run(idle_exit_s=1.0)
    rec = JobStore(redis_client).get(job.id)
    assert rec.state.value == "succeeded", rec.error
    return f"file://{out}"


def test_dataset_thinking_mode_must_match_the_spec(redis_client, tmp_path, tiny_qwen3_dir):
    dataset = _tokenize(redis_client, tmp_path, tiny_qwen3_dir, thinking=False)
    assert load_dataset(dataset).manifest["thinking"] is False
    spec = TrainSpec.model_validate(tiny_spec(dataset, tiny_qwen3_dir, f"file://{tmp_path}/o"))
    assert spec.enable_thinking is True  # the default
    with pytest.raises(TrainError) as info:
        prepare(run_config(spec), DistInfo())
    msg = str(info.value)
    assert "manifest.json" in msg and "thinking=false" in msg and "enable_thinking=true" in msg

    matching = spec.model_copy(update={"enable_thinking": False})
    setup = prepare(run_config(matching), DistInfo())
    assert setup.dataset.thinking is False


def test_thinking_mode_recorded_true_and_old_manifests_load(redis_client, tmp_path, tiny_qwen3_dir, tiny_dataset):
    dataset = _tokenize(redis_client, tmp_path, tiny_qwen3_dir, thinking=True)
    assert load_dataset(dataset).thinking is True
    off = TrainSpec.model_validate(tiny_spec(dataset, tiny_qwen3_dir, f"file://{tmp_path}/o", enable_thinking=False))
    with pytest.raises(TrainError, match="thinking=true.*enable_thinking=false"):
        prepare(run_config(off), DistInfo())
    # a manifest written before the mode was recorded: no check, either mode trains
    assert "thinking" not in load_dataset(tiny_dataset).manifest
    old = TrainSpec.model_validate(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/o2",
                                             enable_thinking=False))
    assert prepare(run_config(old), DistInfo()).dataset.thinking is None
