"""The GPU check's CPU rehearsal runs every stage and writes every figure (so the check cannot rot)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "benchmarks" / "gpu_check.py"

POSITIVE = {
    "peak": ["tflops", "bf16_tflops_measured", "fp32_tflops_measured"],
    "target_forward": ["tokens_per_s", "samples_per_s", "tflop_per_sample", "mfu"],
    "drafter_step": ["tflop_per_sample", "parameters", "flex_vs_sdpa", "autocast_vs_fp32"],
    "drafter_step.sdpa": ["tokens_per_s", "step_s", "mfu"],
    "drafter_step.flex": ["tokens_per_s", "step_s", "mfu"],
    "drafter_step.sdpa_bf16_autocast": ["tokens_per_s", "step_s", "mfu"],
    "draft_vocab": ["vocab", "rows_per_step"],
    "draft_vocab.full": ["tokens_per_s", "step_s"],
    "draft_vocab.64": ["tokens_per_s", "step_s"],
    "draft_vocab.dspark:full": ["tokens_per_s", "step_s", "vs_dflash"],
    "draft_vocab.dspark:64": ["tokens_per_s", "step_s", "vs_dflash"],
    "draft_vocab.dflash2:full": ["tokens_per_s", "step_s", "vs_dflash"],
    "pipeline_inprocess": ["tokens_per_s", "vs_target_forward", "vs_one_gpu_bound", "one_gpu_bound_tokens_per_s"],
    "pipeline_colocated": ["tokens_per_s", "vs_target_forward", "vs_one_gpu_bound", "shm_bytes", "calls"],
    "transfer": ["device_to_host_gbps", "host_to_shm_gbps", "shm_to_pinned_host_gbps", "pinned_host_to_device_gbps",
                 "pageable_host_to_device_gbps", "end_to_end_gbps", "bytes"],
    "node_split": ["target_gpus", "trainer_gpus", "node_tokens_per_s", "default_node_tokens_per_s", "vs_default"],
    "hidden_cache": ["bytes", "file_bytes", "shards", "fill_s", "fill_mb_s", "cache_read_mb_s", "raw_read_mb_s",
                     "cache_read_warm_mb_s", "raw_read_warm_mb_s", "cache_vs_raw_read", "cached_vs_online"],
    "hidden_cache.pipeline_cached": ["tokens_per_s", "vs_target_forward", "samples_from_cache"],
}
FRACTIONS = {"pipeline_inprocess": ["data_wait_fraction"], "pipeline_colocated": ["data_wait_fraction"],
             "hidden_cache.pipeline_cached": ["data_wait_fraction"]}


def _at(report: dict, path: str) -> dict:
    node = report
    for part in path.split("."):
        assert part in node, f"{path}: {part!r} missing"
        node = node[part]
    return node


def _positive(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_cpu_rehearsal_writes_every_figure(tmp_path):
    out = tmp_path / "gpu-check.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())

    assert report["errors"] == {}, report["errors"]
    assert report["rehearsal"] is True and "rehearsal" in proc.stdout
    device = report["device"]
    assert device["type"] == "cpu" and device["name"] and device["torch"] == __import__("torch").__version__
    assert device["cuda"] and device["shape"]["target_layer_ids"]
    for path, keys in POSITIVE.items():
        node = _at(report, path)
        for key in keys:
            assert _positive(node.get(key)), f"{path}.{key} = {node.get(key)!r}"
    for path, keys in FRACTIONS.items():
        for key in keys:
            value = _at(report, path)[key]
            assert isinstance(value, float) and 0 <= value <= 1, f"{path}.{key} = {value!r}"
    assert report["drafter_step"]["flex"]["forward_only"] is True  # torch has no flex backward on the CPU
    assert report["drafter_step"]["trainer_backend"] == "sdpa"
    assert report["pipeline_colocated"]["shm_bytes"] > 0  # the hidden states came through shared memory
    cache = report["hidden_cache"]
    assert "skipped" not in cache and cache["dtype"] == "float32" and cache["samples"] >= 16
    assert Path(cache["path"]).name == "hidden-state-cache" and "gpu-check-" in cache["path"] and cache["file_system"]
    shape = device["shape"]
    assert cache["pipeline_cached"]["samples_from_cache"] == shape["warmup"] + shape["steps"]
    assert "pipeline cached" in proc.stdout and "cache read" in proc.stdout

    gen = report["generation"]["batch_sizes"]
    assert len(gen) >= 2
    for row in gen.values():
        assert _positive(row["tokens_per_s"]) and row["generated_tokens"] >= 1

    split = report["node_split"]
    assert split["target_gpus"] + split["trainer_gpus"] == split["gpus"] == 8
    assert len(split["splits"]) == 7 and split["vs_default"] >= 1
    assert split["node_tokens_per_s"] == max(r["node_tokens_per_s"] for r in split["splits"])
    values = split["chart_values"]
    assert values["trainer.gpus"] == split["trainer_gpus"]
    assert values.get("trainer.colocated.gpus", values.get("target.replicas")) == split["target_gpus"]
    for stage in POSITIVE:
        assert stage.split(".")[0] in report["stage_seconds"]
    assert "8-GPU node split" in proc.stdout and str(out) in proc.stdout
    assert "drafter step, 64-row vocab" in proc.stdout  # the pruned head beside the full one


def test_cache_stage_skips_with_a_note_when_the_budget_is_spent(tmp_path, monkeypatch):
    from dfp_shared.hidden_states import ModelInfo

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # its dataclasses resolve their module by name
    spec.loader.exec_module(gpu_check)
    shape = dataclasses.replace(gpu_check.TINY, notes=[])
    info = ModelInfo(model_id="t", fingerprint="f", num_layers=shape.layers, hidden_size=shape.hidden,
                     vocab_size=shape.vocab, dtype="bfloat16", layer_ids=gpu_check.layer_ids(shape),
                     max_tokens_per_request=0)

    class Target:
        def model_info(self):
            return info

    out = gpu_check.hidden_cache(Target(), None, shape, None, tmp_path, time.perf_counter(), 100.0, 100.0, 100.0)
    assert "time budget" in out["skipped"] and out["path"].startswith(str(tmp_path)) and out["dtype"] == "bfloat16"
    assert shape.notes == [f"hidden-state cache skipped: {out['skipped']}"]
    assert not (tmp_path / "hidden-state-cache").exists()  # nothing was written
    assert "skipped" in gpu_check.table({"hidden_cache": out})
