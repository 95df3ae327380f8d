"""Checkpoints: atomic pointer, keep-K, and resume after SIGTERM equals an uninterrupted run bit for bit."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import torch
from dfp_shared.storage.store import open_store
from dfp_trainer.components.checkpoint import CheckpointError, CheckpointManager
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.run import EXIT_STOPPED, train

from tests.trainer.train_support import (
    cli,
    final_weights,
    run_config,
    subprocess_env,
    tiny_spec,
    torch_threads,
)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def test_checkpoints_keep_last_k_and_pointer_names_verified_files(tmp_path):
    store = open_store(f"file://{tmp_path}/ck")
    mgr = CheckpointManager(store, keep=2)
    model = torch.nn.Linear(3, 2)
    for step in (5, 10, 15):
        with torch.no_grad():
            model.weight.fill_(step)
        mgr.save(step, model, {"optimizer": {}, "sampler": {"epoch": 0, "position": step}})
    assert mgr.steps() == [10, 15]
    assert mgr.latest()["step"] == 15
    fresh = torch.nn.Linear(3, 2)
    state = mgr.load(fresh)
    assert state["step"] == 15 and state["sampler"]["position"] == 15
    assert torch.equal(fresh.weight, torch.full((2, 3), 15.0))
    # a crash while writing step 20 leaves files but no pointer: 15 stays the latest
    store.put("step-00000020/model.safetensors", b"partial")
    assert mgr.latest()["step"] == 15
    store.put("step-00000015/trainer.safetensors", b"corrupted")
    with pytest.raises(CheckpointError, match="checksum"):
        mgr.load(fresh)


def test_resume_after_sigterm_is_bit_identical(tmp_path, tiny_qwen3_dir, tiny_dataset):
    steps = 10
    # reference: uninterrupted, in this process
    ref = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/ref", steps=steps)
    result = train(run_config(ref), DistInfo())
    assert result.completed and result.step == steps

    # interrupted: a real process gets SIGTERM mid-run, checkpoints, exits; a second process resumes
    out = f"file://{tmp_path}/cut"
    args = ["trainer", "train", "--dataset", tiny_dataset, "--target", str(tiny_qwen3_dir), "--output", out]
    for k, v in tiny_spec(tiny_dataset, tiny_qwen3_dir, out, steps=steps).items():
        if k not in ("dataset", "target", "output"):
            args += ["--set", f"{k}={json.dumps(v)}"]
    env = subprocess_env(DFLASH_PROGRESS_EVERY_S="0.001")
    proc = subprocess.Popen(cli(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if '"training progress"' in line and json.loads(line).get("step", 0) >= 2:
            proc.send_signal(signal.SIGTERM)
            break
    proc.stderr.read()
    assert proc.wait(timeout=300) == EXIT_STOPPED
    cut_step, _ = final_weights(out)
    assert 2 <= cut_step < steps
    done = subprocess.run(cli(*args), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == steps
    assert '"resumed"' in done.stderr

    ref_step, ref_w = final_weights(ref["output"])
    got_step, got_w = final_weights(out)
    assert ref_step == got_step == steps
    assert ref_w.keys() == got_w.keys()
    for name in ref_w:
        assert torch.equal(ref_w[name], got_w[name]), name
