"""A hybrid target (Qwen3.5-style: linear- and full-attention layers) and a Llama target through every stage of the
demo-sized pipeline: generation, tokenization, hidden states over gRPC, training, τ and export."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.cli import ROOT


@pytest.mark.timeout(900)
def test_demo_pipeline_on_a_hybrid_target(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT / "services")}
    run = subprocess.run([sys.executable, "-m", "dfp_cli.main", "demo", "--out", str(out), "--target", "tiny", "--hybrid-target",
                          "--prompts", "6", "--max-new-tokens", "12", "--train-steps", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=850)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    store = out / "store"
    target = json.loads((store / "models" / "tiny-qwen3_5" / "config.json").read_text())
    assert {"linear_attention", "full_attention"} <= set(target["layer_types"])
    completions = [json.loads(line) for f in sorted((store / "generate" / "completions").glob("*.jsonl"))
                   for line in f.read_text().splitlines()]
    assert len(completions) == 6
    assert json.loads((store / "tokens" / "manifest.json").read_text())["num_samples"] > 0
    report = json.loads((store / "train" / "report.json").read_text())
    assert report["evaluation"]["tau_trained"] >= 1.0 and report["history"]
    drafter = json.loads((store / "train" / "drafter" / "config.json").read_text())
    assert drafter["num_target_layers"] == target["num_hidden_layers"]
    assert (store / "train" / "drafter-speculators" / "config.json").exists()
    assert "vllm serve" in log and "speculative-config" in log


@pytest.mark.timeout(900)
def test_demo_pipeline_on_a_llama_target_without_mask_token_or_thinking(tmp_path):
    """A Llama-architecture target shaped like SmolLM2 (tied embeddings, ChatML without thinking mode, no mask
    token) through every stage: the trainer picks a spare special token as the mask, and the export records it."""
    from transformers import AutoTokenizer

    out = tmp_path / "demo"
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT / "services")}
    run = subprocess.run([sys.executable, "-m", "dfp_cli.main", "demo", "--out", str(out), "--target", "llama",
                          "--prompts", "6", "--max-new-tokens", "12", "--train-steps", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=850)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    store = out / "store"
    model_dir = store / "models" / "tiny-llama-hd16"
    target = json.loads((model_dir / "config.json").read_text())
    assert target["model_type"] == "llama" and target["tie_word_embeddings"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert "<|MASK|>" not in tokenizer.get_vocab()
    manifest = json.loads((store / "tokens" / "manifest.json").read_text())
    assert manifest["num_samples"] > 0 and manifest["thinking"] is False
    drafter = json.loads((store / "train" / "drafter" / "config.json").read_text())
    mask = tokenizer.convert_ids_to_tokens(drafter["dflash_config"]["mask_token_id"])
    assert mask in tokenizer.all_special_tokens and mask not in tokenizer.chat_template
    report = json.loads((store / "train" / "report.json").read_text())
    assert report["evaluation"]["tau_trained"] >= 1.0
    assert (store / "train" / "drafter-speculators" / "config.json").exists()
