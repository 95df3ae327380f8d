"""τ by replay: the steps greedy speculative decoding counts, from the target's greedy output in one forward."""

from __future__ import annotations

import pytest
import torch
from dfp_shared.models.stop_tokens import stop_token_ids
from dfp_trainer.evaluate.decode import speculative_decode
from dfp_trainer.evaluate.replay import replay_decode, walk
from dfp_trainer.evaluate.tau import tau_figures

from tests.trainer.drafter_support import one_thread
from tests.trainer.evaluate.test_batched import FAMILIES, _drafter, _loaded, _prompts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_counts_what_decoding_counts_for_each_family(tiny_qwen3_dir, family):
    with one_thread():
        tok, target = _loaded(tiny_qwen3_dir)
        drafter = _drafter(tiny_qwen3_dir, tok, target, **FAMILIES[family])
        prompts, stops = _prompts(tok), stop_token_ids(tok)
        decoded = [speculative_decode(drafter, target, p, max_new_tokens=20, stop_token_ids=stops, whole_blocks=True)
                   for p in prompts]
        replayed = replay_decode(drafter, target, prompts, [r["new_ids"] for r in decoded], max_new_tokens=20,
                                 stop_token_ids=stops)
    for d, r in zip(decoded, replayed):
        assert r["new_ids"] == d["new_ids"] and r["steps"] == d["steps"]
        # drafts past the output's end are unknown to a replay: only a block reaching past the budget may differ
        assert [min(a, 20 - 1 - sum(d["steps"][:i]) - 1) for i, a in enumerate(d["accepted"])] == \
            [min(a, 20 - 1 - sum(r["steps"][:i]) - 1) for i, a in enumerate(r["accepted"])]
    assert tau_figures(replayed, drafter.config.block_size - 1)["tau"] == \
        tau_figures(decoded, drafter.config.block_size - 1)["tau"]


def test_replay_counts_what_decoding_counts_when_drafts_are_accepted(tiny_qwen3_dir, monkeypatch):
    with one_thread():
        tok, target = _loaded(tiny_qwen3_dir)
        drafter = _drafter(tiny_qwen3_dir, tok, target)
        prompts, stops = _prompts(tok), stop_token_ids(tok)
        repeated = speculative_decode(drafter, target, prompts[0], max_new_tokens=20)["new_ids"][-1]  # the target's
        # favourite token (its greedy output settles on it); the drafter drafts it where its state says so, else
        # the anchor: drafts that depend on the features and the block, accepted in runs of every length
        monkeypatch.setattr(drafter, "draft", lambda hidden, anchor: torch.where(
            hidden[:, 0] > -0.5, torch.full_like(hidden[:, 0], repeated, dtype=torch.long), anchor.expand(hidden.shape[0])))
        decoded = [speculative_decode(drafter, target, p, max_new_tokens=24, stop_token_ids=stops, whole_blocks=True)
                   for p in prompts]
        replayed = replay_decode(drafter, target, prompts, [r["new_ids"] for r in decoded], max_new_tokens=24,
                                 stop_token_ids=stops)
    accepted = [a for r in decoded for a in r["accepted"]]
    assert 0 < sum(accepted) and len(set(accepted)) > 2  # blocks accepted in part and whole were compared
    assert [r["steps"] for r in replayed] == [r["steps"] for r in decoded]
    assert tau_figures(replayed, 5)["tau"] == tau_figures(decoded, 5)["tau"]


def test_the_walk_follows_the_accepted_drafts_from_anchor_to_anchor():
    out = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    drafts = torch.tensor([[11, 12, 99], [0, 0, 0], [0, 0, 0], [14, 15, 16], [0, 0, 0], [0, 0, 0], [0, 0, 0],
                           [18, 0, 0], [0, 0, 0]])
    run = walk(drafts, out, max_new_tokens=9, stop_token_ids=())
    # anchor 0 accepts 11, 12 and the target adds 13; anchor 3 accepts 14..16, adds 17; anchor 7 accepts 18 (budget)
    assert run["steps"] == [3, 4, 1] and run["accepted"] == [2, 3, 1] and run["new_ids"] == out
    assert run["accepted_hist"] == [0, 1, 1, 1]
    stopped = walk(drafts, out, max_new_tokens=9, stop_token_ids=(15,))
    assert stopped["steps"] == [3, 2] and stopped["new_ids"] == out[:6]  # cut at the stop token
    assert walk(drafts, [15, 1], max_new_tokens=9, stop_token_ids=(15,))["steps"] == []  # the prefill stopped it


def test_an_evaluate_job_by_replay_reports_what_decoding_reports(tiny_qwen3_dir, tmp_path):
    import json

    from dfp_shared.specs.evaluate import EvaluateSpec
    from dfp_trainer.evaluate.job import evaluate_job
    from dfp_trainer.export.zlab import export_drafter

    from tests.trainer.drafter_support import chat_prompts

    with one_thread():
        tok, target = _loaded(tiny_qwen3_dir)
        export_drafter(_drafter(tiny_qwen3_dir, tok, target), tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chat_prompts(1, 3)))
    sets = {}
    for method in ("decode", "replay"):
        spec = EvaluateSpec.model_validate({
            "drafter": f"file://{tmp_path}/drafter", "target": f"file://{tiny_qwen3_dir}",
            "prompts": [f"file://{prompts}"], "output": f"file://{tmp_path}/{method}", "max_new_tokens": 12,
            "batch_size": 2, "dflash_method": method})
        with one_thread():
            sets[method] = evaluate_job(spec, device="cpu")["sets"][0]
    for key in ("tau", "steps", "new_tokens", "accepted_hist"):
        assert sets["replay"]["dflash"][key] == sets["decode"]["dflash"][key]
    assert sets["replay"]["ngram"] == {**sets["decode"]["ngram"], "seconds": sets["replay"]["ngram"]["seconds"],
                                       "tokens_per_s": sets["replay"]["ngram"]["tokens_per_s"]}
