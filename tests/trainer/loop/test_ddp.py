"""DDP: 2 CPU ranks (torchrun, gloo over loopback) train the same parameters as 1 rank on the same global batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.run import train

from tests.trainer.train_support import final_weights, run_config, subprocess_env, tiny_spec, torch_threads

# gradients are averaged by all-reduce on 2 ranks and by accumulation on 1: float32 rounding differs
# slightly, and Adam's normalisation carries that into the weights; anything else would be far larger
ATOL = 2e-5


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.mark.parametrize("family", [{}, {"family": "dspark", "markov_rank": 8}], ids=["dflash", "dspark"])
def test_two_ranks_match_one_rank_with_the_same_global_batch(tmp_path, tiny_qwen3_dir, tiny_dataset, family):
    """DSpark's heads run on the drafter's output outside DDP's forward: their gradients are all-reduced too."""
    steps = 4
    # 1 rank, the global batch in 2 accumulation steps (the same sample groups the 2 ranks get)
    one = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/one", steps=steps, grad_accum=2,
                    tokens_per_batch=256, **family)
    single = train(run_config(one), DistInfo())
    assert single.completed

    two = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/two", steps=steps, grad_accum=1,
                    tokens_per_batch=256, **family)
    spec_path, result_path = tmp_path / "spec.json", tmp_path / "result.json"
    spec_path.write_text(json.dumps(two))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dfp_trainer.run", "--spec", str(spec_path), "--result", str(result_path)]
    done = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(result_path.read_text())
    assert result["completed"] and result["step"] == steps
    assert 0.0 <= result["summary"]["comm_fraction"] < 1.0  # gradient sync share of step time, reported

    s1, w1 = final_weights(one["output"])
    s2, w2 = final_weights(two["output"])
    assert s1 == s2 == steps
    moved = 0.0
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=ATOL, rtol=0, msg=name)
        moved = max(moved, float((w1[name] - w1[name].mean()).abs().max()))
    assert moved > 0  # the comparison is between trained weights, not two copies of the init
    assert not family or {"markov_head.markov_w2.weight", "confidence_head.proj.weight"} <= set(w1)
    # the loss curves agree too (metrics reduced across ranks)
    h1 = [r["loss"] for r in single.history]
    assert len(h1) == steps
    assert abs(result["summary"]["final_loss"] - h1[-1]) < 1e-3 * max(1.0, abs(h1[-1]))
