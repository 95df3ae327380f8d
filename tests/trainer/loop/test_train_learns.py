"""The trainer's own train() (sampler, input pipeline, LR schedule, evaluation) learns on the tiny
target's generations: the training loss falls and the trained drafter's τ beats the untrained one's."""

from __future__ import annotations

from dfp_shared.specs.train import TrainSpec
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.run import train

from tests.trainer.train_support import run_config, tiny_spec, torch_threads

STEPS = 80


def test_train_lowers_loss_and_beats_the_untrained_drafter(tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = TrainSpec.model_validate(tiny_spec(
        tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/run", steps=STEPS, lr=1e-2, warmup_ratio=0.05,
        decay="constant", block_size=8, max_anchors=4, tokens_per_batch=256, checkpoint_every=STEPS,
        eval_prompts=4, eval_max_new_tokens=24))
    assert spec.enable_thinking  # the default mode
    with torch_threads(1):
        result = train(run_config(spec, evaluate=True, progress_every_s=3600.0), DistInfo())

    assert result.completed and result.step == STEPS
    losses = [row["loss"] for row in result.history]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    out = result.outputs
    print(f"loss {first:.3f} -> {last:.3f}; tau {out['tau_untrained']:.2f} -> {out['tau_trained']:.2f}; "
          f"held-out loss {out['heldout_loss_untrained']:.3f} -> {out['heldout_loss']:.3f}; "
          f"held-out per position {out['heldout_per_position_accuracy']}; predicted tau {out['tau_predicted']:.2f}, "
          f"gap {out['tau_gap']:+.2f} (noise {out['tau_gap_noise']:.2f}): {out['mismatch_reason']}")
    assert last < 0.7 * first
    assert out["tau_trained"] > out["tau_untrained"]
    assert out["heldout_loss"] < out["heldout_loss_untrained"]
    assert len(out["heldout_per_position_accuracy"]) == spec.block_size - 1
    # honest: served as scored, so the measured tau is within noise of what the held-out accuracies predict
    assert 1.0 < out["tau_predicted"] < spec.block_size and out["tau_gap_noise"] > 0
    assert out["train_serve_mismatch"] is False, out["mismatch_reason"]
