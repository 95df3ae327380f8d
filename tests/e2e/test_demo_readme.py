"""The README's first command, run as a new user would: a copy of the checkout, a new virtual
environment made by ``make demo``, the whole pipeline on the CPU with the learnable target, and a trained
drafter whose acceptance length beats the untrained one's and n-gram speculation's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.cli import ROOT


def copy_checkout(dest: Path) -> None:
    """The files a clone would have (tracked and not ignored), without this checkout's venv or caches."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for rel in listed:
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.mark.fresh_install
@pytest.mark.timeout(1800)
def test_make_demo_in_a_new_virtual_environment(tmp_path):
    repo = tmp_path / "dflash-pipeline"
    copy_checkout(repo)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["COLUMNS"] = "200"
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "/.venv/" not in p)
    started = time.monotonic()
    out = subprocess.run(["make", "demo"], cwd=repo, env=env, capture_output=True, text=True, timeout=1700)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    assert (repo / ".venv" / "bin" / "dflash-pipeline").exists()  # the demo installed itself
    print(f"make demo (install included) took {time.monotonic() - started:.0f} s")  # reported, not asserted

    tau = re.search(r"acceptance length tau: trained ([0-9.]+) vs untrained ([0-9.]+), n-gram speculation ([0-9.]+)",
                    log)
    assert tau, log[-4000:]
    trained, untrained, ngram = (float(tau.group(i)) for i in (1, 2, 3))
    assert trained > untrained and trained > ngram, log[-4000:]

    train = repo / "demo-output" / "store" / "train"
    report = json.loads((train / "report.json").read_text())
    assert abs(report["evaluation"]["tau_trained"] - trained) < 0.01
    assert (train / "loss_curve.png").stat().st_size > 1000
    assert (train / "position_accuracy.png").stat().st_size > 1000
    assert json.loads((train / "drafter" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert (train / "drafter" / "modeling_dflash.py").exists()
    assert "speculators_config" in json.loads((train / "drafter-speculators" / "config.json").read_text())
    assert "vllm serve" in log and "--speculative-algorithm DFLASH" in log and "AutoModel.from_pretrained" in log
    completions = list((repo / "demo-output" / "store" / "generate" / "completions").glob("shard-*.jsonl"))
    assert sum(len(f.read_text().splitlines()) for f in completions) == 128  # the learnable target's prompts
    assert list((repo / "demo-output" / "store" / "models").glob("learnable-qwen3-*/config.json"))
    assert (repo / "demo-output" / "store" / "tokens" / "manifest.json").exists()
    leftovers = subprocess.run(["pgrep", "-f", str(repo)], capture_output=True, text=True).stdout.split()
    assert not leftovers, "demo left processes running"
