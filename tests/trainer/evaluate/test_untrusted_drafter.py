"""A hostile drafter for an ``evaluate`` job: a config.json whose MLP would take hundreds of gigabytes fails the
job at once in a real trainer worker (naming the file and the limit, never redelivered, the worker's memory
bounded); widths beyond the target's, and weights whose header disagrees with the config, are refused before
anything is built or read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.load import load_exported
from dfp_trainer.drafter.model import DFlashDrafter
from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id
from dfp_trainer.export.zlab import export_drafter
from safetensors.torch import save_file

from tests.trainer.test_untrusted_gguf import GiB, _reap, _start_worker


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_qwen3_dir):
    tok = load_tokenizer(tiny_qwen3_dir)
    parts = load_target_parts(tiny_qwen3_dir)
    cfg = DrafterConfig.for_target(parts.config, num_layers=1, block_size=4, mask_token_id=mask_token_id(tok))
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(cfg, parts.embed_tokens, parts.lm_head), tmp_path_factory.mktemp("drafter"))


def _hostile(drafter_dir, tmp_path, name: str, weights: bytes | None = None, **changes):
    out = tmp_path / name
    shutil.copytree(drafter_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (out / "model.safetensors").write_bytes(weights)
    return out


def test_an_oversized_drafter_config_fails_the_evaluate_job_at_once(tmp_path, redis_server, redis_client,
                                                                    drafter_dir, tiny_qwen3_dir):
    layers = 64
    huge = _hostile(drafter_dir, tmp_path, "huge", weights=b"", intermediate_size=4_000_000,
                    num_hidden_layers=layers, layer_types=["full_attention"] * layers, max_window_layers=layers)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Name three rivers."}) + "\n")
    job, _ = queue_job(redis_client, "evaluate", {
        "drafter": huge.as_uri(), "target": f"file://{tiny_qwen3_dir}", "prompts": [(tmp_path / "p.jsonl").as_uri()],
        "output": (tmp_path / "eval").as_uri(), "max_new_tokens": 4})
    proc = _start_worker(redis_server, "--max-tasks", "1", "--idle-exit", "5")
    code, peak = _reap(proc, timeout=240)
    assert code == 0, proc.stderr.read()[-3000:]
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.failed
    assert f"{huge}/config.json" in rec.error and "intermediate_size 4000000" in rec.error, rec.error
    assert "16 x hidden_size" in rec.error
    queue = TaskQueue(redis_client, "train")
    assert queue.dead_letters() == [] and queue.pending() == 0
    print(f"peak worker RSS {peak >> 20} MiB")
    assert peak < 2 * GiB


def test_widths_beyond_the_target_s_and_a_disagreeing_weights_header_are_refused_before_loading(
        tmp_path, drafter_dir, tiny_qwen3_dir):
    parts = load_target_parts(tiny_qwen3_dir)
    target = parts.config

    def load(directory):
        return load_exported(directory, parts.embed_tokens, parts.lm_head, target_config=target)

    assert load(drafter_dir).config.intermediate_size == target["intermediate_size"]
    wide = _hostile(drafter_dir, tmp_path, "wide", intermediate_size=2 * target["intermediate_size"])
    with pytest.raises(ValueError, match="intermediate_size .* is larger than the target's"):
        load(wide)
    heads = _hostile(drafter_dir, tmp_path, "heads", num_attention_heads=2 * target["num_attention_heads"],
                     num_key_value_heads=2 * target["num_attention_heads"])
    with pytest.raises(ValueError, match="num_attention_heads .* larger than the target's"):
        load(heads)
    # weights that claim a tensor the config has not: refused from the header, before a byte of it is read
    extra = _hostile(drafter_dir, tmp_path, "extra")
    save_file({"fc.weight": torch.zeros(1, 1), "smuggled": torch.zeros(4, 4)}, str(extra / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor names do not match the config .*'smuggled'"):
        load(extra)
