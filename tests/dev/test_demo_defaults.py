"""What the demo runs by default: the learnable target and 128 of its training prompts; the random targets
keep 32 of their built-in prompts, and the serving check's default prompts are the demo target's held-out ones."""

from __future__ import annotations

import json

from click.testing import CliRunner
from dfp_cli.main import cli
from dfp_dev.demo import run as demo_run
from dfp_dev.demo.config import DemoConfig
from dfp_dev.serving.check import load_prompts


def test_the_learnable_target_with_128_prompts_is_the_default(tmp_path):
    cfg = DemoConfig(out_dir=tmp_path)
    assert (cfg.target, cfg.prompt_count()) == ("learnable", 128)
    assert DemoConfig(out_dir=tmp_path, target="tiny").prompt_count() == 32
    assert DemoConfig(out_dir=tmp_path, target="llama", prompts=12).prompt_count() == 12


def test_a_hybrid_target_without_a_target_flag_is_the_tiny_one(monkeypatch):
    seen = []
    monkeypatch.setattr(demo_run, "run_demo", lambda cfg: seen.append(cfg) or 0)
    out = CliRunner().invoke(cli, ["demo", "--hybrid-target"])
    assert out.exit_code == 0, out.output
    assert seen[0].target == "tiny" and seen[0].hybrid_target
    refused = CliRunner().invoke(cli, ["demo", "--hybrid-target", "--target", "learnable"])
    assert refused.exit_code != 0 and "not one" in refused.output


def test_serve_check_defaults_to_the_targets_held_out_prompts(tmp_path):
    target = tmp_path / "learnable-qwen3-x"
    (target / "prompts").mkdir(parents=True)
    held_out = [{"id": f"held-{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(5)]
    (target / "prompts" / "held-out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    messages, ids = load_prompts(None, limit=3, target=target)
    assert ids == ["held-0", "held-1", "held-2"] and messages[0] == held_out[0]["messages"]
    # a random target has none beside it: the built-in prompts the demo does not train on
    _, ids = load_prompts(None, limit=2, target=tmp_path)
    assert ids == ["demo-032", "demo-033"]
