"""The peer benchmark's sample conversion keeps our samples exactly, and its anchor count follows our sampler."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_speculators as peer  # noqa: E402
from dfp_trainer.drafter.objective import sample_anchors  # noqa: E402


def flat(samples: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor([t for s, _ in samples for t in s], dtype=torch.int32)
    mask = torch.tensor([m for _, ms in samples for m in ms], dtype=torch.uint8)
    offsets = torch.tensor([0] + [len(s) for s, _ in samples]).cumsum(0)
    return ids, mask, offsets


SAMPLES = [([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1]), ([7, 8, 9], [0, 1, 1]), ([10, 11, 12, 13, 14], [0, 1, 0, 1, 1]),
           ([15, 16], [0, 0])]


def test_selected_samples_keep_ids_and_masks_cut_to_max_length():
    ids, mask, offsets = flat(SAMPLES)
    keep = torch.tensor([0, 2, 1])
    out_ids, out_mask, out_offsets = peer.select_samples(ids, mask, offsets, keep, max_length=4)
    assert out_ids.dtype == torch.int64 and out_mask.dtype == torch.uint8
    assert out_offsets.tolist() == [0, 4, 8, 11]
    for row, i in enumerate(keep.tolist()):
        a, b = int(out_offsets[row]), int(out_offsets[row + 1])
        want_ids, want_mask = SAMPLES[i]
        assert out_ids[a:b].tolist() == want_ids[:4] and out_mask[a:b].tolist() == want_mask[:4]


def test_no_sample_selected():
    ids, mask, offsets = flat(SAMPLES)
    out_ids, out_mask, out_offsets = peer.select_samples(ids, mask, offsets, torch.zeros(0, dtype=torch.int64), 8)
    assert out_ids.numel() == 0 and out_mask.numel() == 0 and out_offsets.tolist() == [0]


def test_anchors_a_step_equal_our_sampler_count():
    """Per sequence: as many anchors as our sampler draws (positions with this and the next token trained), at
    most ``max_anchors``; averaged over the batches."""
    ids, mask, offsets = flat(SAMPLES)
    batches = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    counted = peer.anchors_a_step((ids, mask, offsets), batches, max_anchors=2)
    drawn = []
    for batch in batches:
        total = 0
        for i in batch.tolist():
            _, m = SAMPLES[i]
            valid = sample_anchors(torch.tensor([m]), torch.tensor([len(m)]), 2)[1]
            total += int(valid.sum())
        drawn.append(total)
    assert counted == sum(drawn) / len(drawn) == 2.0  # (2 + 1) and (1 + 0)


def test_peer_layer_ids_are_ours_plus_one():
    """vLLM's speculators loader serves auxiliary layer i as our target layer i - 1 (the output of layer i - 1)."""
    assert peer.peer_layer_ids([1, 3]) == [2, 4]


def test_pins_hash_names_the_environment():
    assert peer.env_dir("/tmp/x").name == f"speculators-{peer.pins_hash()}"
    assert "speculators==0.9.0" in peer.NO_DEPS and peer.TORCH == "torch==2.13.0"


def test_check_servable_reads_a_speculators_layout(tmp_path):
    """A speculators export nests the draft layers' config: vLLM's CPU head sizes and the mixed-layer refusal apply
    to it as to a z-lab export."""
    import json

    import pytest
    from dfp_dev.serving.vllm_server import check_servable

    def export(name: str, **layers) -> Path:
        d = tmp_path / name
        d.mkdir()
        config = {"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"], "block_size": 8,
                  "transformer_layer_config": {"model_type": "qwen3", "hidden_size": 128, "num_attention_heads": 4,
                                               "head_dim": 32, **layers}}
        (d / "config.json").write_text(json.dumps(config))
        return d

    check_servable(export("ok", layer_types=["full_attention", "full_attention"]), "drafter")
    with pytest.raises(ValueError, match="head_dim 48"):
        check_servable(export("head", head_dim=48), "drafter")
    with pytest.raises(ValueError, match="mixes sliding_attention and full_attention"):
        check_servable(export("mixed", layer_types=["sliding_attention", "full_attention"]), "drafter")


def test_comparison_serves_the_chosen_prompt_set_and_reads_our_cut(tmp_path):
    """The comparison serves the set its context names (MT-Bench for a real target) and falls back to the held-out
    one; the peer's samples are cut where our recipe cuts them."""
    import json

    import peer_compare

    def prompt_set(name: str, texts: list[str]) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"id": f"{name}-{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                                for i, t in enumerate(texts)))
        return path

    heldout, mtbench = prompt_set("heldout.jsonl", ["a", "b"]), prompt_set("mtbench.jsonl", ["x", "y", "z"])
    ctx = {"heldout": heldout, "eval_prompts": 2, "model": tmp_path}
    assert [m[0]["content"] for m in peer_compare.served_prompts(ctx)[0]] == ["a", "b"]
    assert [m[0]["content"] for m in peer_compare.served_prompts({**ctx, "served": mtbench})[0]] == ["x", "y"]

    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "drafter" / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "block_size": 8, "draft_vocab_size": None,
        "dflash_config": {"target_layer_ids": [1, 28], "mask_token_id": 2}}))
    assert peer_compare.our_shape(run, {"max_anchors": 16}, 150, 0)["max_length"] == 512
    assert peer_compare.our_shape(run, {"max_anchors": 16, "max_length": 1024}, 150, 0)["max_length"] == 1024
