"""The GPU check's CPU rehearsal runs every stage and writes every figure (so the check cannot rot)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
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
    "pipeline_inprocess": ["tokens_per_s", "vs_target_forward", "vs_one_gpu_bound", "one_gpu_bound_tokens_per_s"],
    "pipeline_colocated": ["tokens_per_s", "vs_target_forward", "vs_one_gpu_bound", "shm_bytes", "calls"],
    "transfer": ["device_to_host_gbps", "host_to_shm_gbps", "shm_to_pinned_host_gbps", "pinned_host_to_device_gbps",
                 "pageable_host_to_device_gbps", "end_to_end_gbps", "bytes"],
    "node_split": ["target_gpus", "trainer_gpus", "node_tokens_per_s", "default_node_tokens_per_s", "vs_default"],
}
FRACTIONS = {"pipeline_inprocess": ["data_wait_fraction"], "pipeline_colocated": ["data_wait_fraction"]}


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
