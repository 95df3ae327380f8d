"""The D-PACE loss: weights by the paper's closed form, the derivative of expected accepted length,
and the loss itself against a direct computation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dfp_trainer.drafter.attention import training_masks
from dfp_trainer.drafter.batch import Batch
from dfp_trainer.drafter.objective import block_targets, dflash_loss, dpace_weights, sample_anchors

from tests.trainer.drafter_support import small_drafter
from tests.trainer.train_support import run_config, tiny_spec, torch_threads


def test_weights_are_suffix_sums_of_smoothed_confidence_products():
    q = torch.tensor([[1.0, 0.9, 0.5, 0.2]])  # position 0 is the anchor
    trained = torch.tensor([[False, True, True, True]])
    w = dpace_weights(-torch.log(q), trained, alpha=0.5)
    r = [0.95, 0.75, 0.6]
    p = [r[0], r[0] * r[1], r[0] * r[1] * r[2]]
    torch.testing.assert_close(w, torch.tensor([[0.0, p[0] + p[1] + p[2], p[1] + p[2], p[2]]]))
    # an untrained position weighs nothing and stops the positions after it, as it stops acceptance
    gap = dpace_weights(-torch.log(q), torch.tensor([[False, True, False, True]]), alpha=0.5)
    torch.testing.assert_close(gap, torch.tensor([[0.0, 0.95, 0.0, 0.0]]))
    # alpha 1: every confidence counts as 1, position k weighs the B - k positions from it on
    torch.testing.assert_close(dpace_weights(-torch.log(q), trained, alpha=1.0), torch.tensor([[0.0, 3.0, 2.0, 1.0]]))


def test_weights_are_the_gradient_of_expected_accepted_length():
    log_q = torch.log(torch.rand(5, 8, generator=torch.Generator().manual_seed(0)) * 0.9 + 0.05)
    log_q[:, 0] = 0.0
    trained = torch.ones(5, 8, dtype=torch.bool)
    trained[:, 0] = False
    x = log_q.clone().requires_grad_(True)
    expected_accepted = torch.cumprod(torch.exp(x[:, 1:]), dim=1).sum()
    (grad,) = torch.autograd.grad(expected_accepted, x)
    torch.testing.assert_close(dpace_weights(-log_q, trained, alpha=1e-9), grad, rtol=1e-5, atol=1e-6)


def test_dpace_loss_matches_a_direct_computation():
    drafter = small_drafter()
    g = torch.Generator().manual_seed(0)
    t = 20
    ids = torch.randint(0, 99, (2, t), generator=g)
    loss_mask = torch.ones(2, t)
    loss_mask[:, :4] = 0
    feats = torch.randn(2, t, 64, generator=g)
    lengths = torch.tensor([t, t - 5])
    batch = Batch(ids, loss_mask, lengths, target_hidden=feats)
    loss, metrics = dflash_loss(drafter, batch, max_anchors=5, generator=torch.Generator().manual_seed(1),
                                logits_chunk=7, loss="dpace", dpace_alpha=0.3)

    cfg = drafter.config
    b = cfg.block_size
    anchors, valid = sample_anchors(loss_mask, lengths, 5, torch.Generator().manual_seed(1))
    labels, weights = block_targets(ids, loss_mask, lengths, anchors, valid, b, 7.0)
    s, n = anchors.shape
    block = torch.full((s, n, b), cfg.mask_token_id)
    block[:, :, 0] = torch.gather(ids, 1, anchors)
    pos = anchors[:, :, None] + torch.arange(b)
    masks = training_masks(anchors, b, t, cfg.layer_types, cfg.sliding_window, "sdpa")
    hidden = drafter(block.view(s, -1), pos.view(s, -1), feats, torch.arange(t), masks)
    logits = drafter.logits(hidden).view(s * n, b, -1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(s * n, b)
    trained = (weights > 0).view(s * n, b)
    q = torch.where(trained, torch.exp(-ce.detach()), torch.zeros(()))
    w = torch.zeros_like(ce)
    for row in range(s * n):
        prod = 1.0
        prods = []
        for k in range(1, b):
            prod *= float(0.7 * q[row, k] + 0.3) if trained[row, k] else 0.0
            prods.append(prod)
        for k in range(1, b):
            w[row, k] = sum(prods[k - 1:]) if trained[row, k] else 0.0
    manual = (ce * w).sum() / trained.any(1).sum()
    torch.testing.assert_close(loss, manual, rtol=1e-5, atol=1e-6)
    assert metrics["weight_sum"] == float(trained.any(1).sum())
    grads = torch.autograd.grad(loss, drafter.trainable_parameters())
    manual_grads = torch.autograd.grad(manual, drafter.trainable_parameters())
    for a, m in zip(grads, manual_grads):  # the weights are constants of the gradient
        torch.testing.assert_close(a, m, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"loss": "focal"}, {"loss": "dpace", "dpace_alpha": 0.0},
                                    {"loss": "dpace", "dpace_alpha": 1.5}])
def test_bad_loss_settings_are_named(kwargs):
    drafter = small_drafter()
    batch = Batch(torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8), torch.tensor([8]),
                  target_hidden=torch.zeros(1, 8, 64))
    with pytest.raises(ValueError, match="loss must be one of"):
        dflash_loss(drafter, batch, **kwargs)


def test_a_train_job_with_the_dpace_loss_trains(tmp_path, tiny_qwen3_dir, tiny_dataset):
    from dfp_shared.specs.train import TrainSpec
    from dfp_trainer.components.distributed import DistInfo
    from dfp_trainer.run import train

    steps = 12
    spec = TrainSpec.model_validate(tiny_spec(
        tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/run", steps=steps, lr=1e-2, decay="constant",
        block_size=8, max_anchors=4, tokens_per_batch=256, checkpoint_every=steps, loss="dpace", eval_prompts=0))
    with torch_threads(1):
        result = train(run_config(spec, evaluate=False, progress_every_s=3600.0), DistInfo())
    losses = [row["loss"] for row in result.history]
    assert result.completed and len(losses) == steps
    assert sum(losses[-4:]) < sum(losses[:4])  # weighted CE per block falls as the drafter learns
