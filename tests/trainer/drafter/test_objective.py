"""The DFlash objective on hand-built cases: anchors, labels, weights, chunking, noise, bad input."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from dfp_trainer.drafter.attention import training_masks
from dfp_trainer.drafter.batch import Batch
from dfp_trainer.drafter.objective import block_targets, dflash_loss, sample_anchors

from tests.trainer.drafter_support import small_drafter


def test_anchors_only_where_anchor_and_next_are_trained():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1],
                              [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    lengths = torch.tensor([10, 6])
    anchors, valid = sample_anchors(loss_mask, lengths, max_anchors=512, generator=torch.Generator().manual_seed(0))
    got = [sorted(a for a, v in zip(row.tolist(), ok.tolist()) if v) for row, ok in zip(anchors, valid)]
    # row 0: 2,3 (4 is followed by an untrained token), 6,7,8 (9 has no next token)
    # row 1: length 6 -> anchors 1..4
    assert got == [[2, 3, 6, 7, 8], [1, 2, 3, 4]]
    assert anchors.shape == (2, 5) and valid[1].tolist() == [True, True, True, True, False]


def test_anchor_sampling_caps_and_is_deterministic():
    loss_mask = torch.ones(3, 200)
    lengths = torch.tensor([200, 150, 3])
    a1, v1 = sample_anchors(loss_mask, lengths, 16, torch.Generator().manual_seed(7))
    a2, v2 = sample_anchors(loss_mask, lengths, 16, torch.Generator().manual_seed(7))
    a3, _ = sample_anchors(loss_mask, lengths, 16, torch.Generator().manual_seed(8))
    assert torch.equal(a1, a2) and torch.equal(v1, v2) and not torch.equal(a1, a3)
    assert v1.sum(1).tolist() == [16, 16, 2]
    assert bool((a1[1][v1[1]] < 149).all())
    assert all(bool((row[ok].diff() > 0).all()) for row, ok in zip(a1, v1))  # sorted, no repeats


def test_labels_and_weights_hand_built():
    ids = torch.arange(100, 112)[None]  # token at position p is 100 + p
    loss_mask = torch.ones(1, 12)
    loss_mask[0, 7] = 0
    lengths = torch.tensor([10])
    anchors, valid = torch.tensor([[5, 8]]), torch.tensor([[True, True]])
    labels, weights = block_targets(ids, loss_mask, lengths, anchors, valid, block_size=4, gamma=2.0)
    assert labels[0, 0].tolist() == [105, 106, 107, 108]  # no shift: block position k -> token at a + k
    d = [math.exp(-k / 2.0) for k in range(3)]
    # anchor 5: position 0 untrained, 6 trained (weight 1), 7 masked out, 8 trained (weight exp(-2/2))
    torch.testing.assert_close(weights[0, 0], torch.tensor([0.0, d[0], 0.0, d[2]]))
    # anchor 8: 9 trained, 10 and 11 beyond the length
    torch.testing.assert_close(weights[0, 1], torch.tensor([0.0, d[0], 0.0, 0.0]))
    _, none = block_targets(ids, loss_mask, lengths, anchors, torch.tensor([[False, False]]), 4, 2.0)
    assert none.sum() == 0


def _manual_loss(drafter, ids, loss_mask, feats, lengths, anchors, valid, gamma):
    """The objective written out directly: full logits, weighted mean cross-entropy."""
    cfg = drafter.config
    b = cfg.block_size
    labels, weights = block_targets(ids, loss_mask, lengths, anchors, valid, b, gamma)
    s, n = anchors.shape
    block = torch.full((s, n, b), cfg.mask_token_id)
    block[:, :, 0] = torch.gather(ids, 1, anchors)
    pos = anchors[:, :, None] + torch.arange(b)
    masks = training_masks(anchors, b, ids.shape[1], cfg.layer_types, cfg.sliding_window, "sdpa")
    hidden = drafter(block.view(s, -1), pos.view(s, -1), feats, torch.arange(ids.shape[1]), masks)
    logits = drafter.logits(hidden).view(s, n, b, -1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce * weights.reshape(-1)).sum() / weights.sum()


def _batch(seed=0, t=20):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 99, (2, t), generator=g)
    loss_mask = torch.ones(2, t)
    loss_mask[:, :4] = 0
    feats = torch.randn(2, t, 64, generator=g)
    return ids, loss_mask, feats, torch.tensor([t, t - 5])


def _as_batch(tensors) -> Batch:
    ids, loss_mask, feats, lengths = tensors
    return Batch(ids, loss_mask, lengths, target_hidden=feats)


def test_loss_matches_direct_computation_and_chunking_does_not_change_it():
    drafter = small_drafter()
    ids, loss_mask, feats, lengths = _batch()
    loss, metrics = dflash_loss(drafter, Batch(ids, loss_mask, lengths, target_hidden=feats), max_anchors=5,
                                gamma=3.0, generator=torch.Generator().manual_seed(1), logits_chunk=5)
    anchors, valid = sample_anchors(loss_mask, lengths, 5, torch.Generator().manual_seed(1))
    manual = _manual_loss(drafter, ids, loss_mask, feats, lengths, anchors, valid, 3.0)
    torch.testing.assert_close(loss, manual, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(loss, drafter.trainable_parameters())

    loss2, _ = dflash_loss(drafter, Batch(ids, loss_mask, lengths, target_hidden=feats), max_anchors=5, gamma=3.0,
                           generator=torch.Generator().manual_seed(1), logits_chunk=10_000)
    grads2 = torch.autograd.grad(loss2, drafter.trainable_parameters())
    torch.testing.assert_close(loss2, loss)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert metrics["num_blocks"] == float(valid.sum())
    assert len(metrics["per_position_accuracy"]) == drafter.config.block_size - 1
    assert metrics["num_trained_tokens"] == sum(metrics["per_position_count"])
    assert 0.0 <= metrics["accuracy"] <= 1.0 and 1.0 <= metrics["mean_accepted"] <= drafter.config.block_size


def test_feature_noise_is_seeded_and_off_by_default():
    drafter = small_drafter()
    batch = _as_batch(_batch())
    clean, _ = dflash_loss(drafter, batch, generator=torch.Generator().manual_seed(3))
    noisy1, _ = dflash_loss(drafter, batch, noise_std=0.5, generator=torch.Generator().manual_seed(3))
    noisy2, _ = dflash_loss(drafter, batch, noise_std=0.5, generator=torch.Generator().manual_seed(3))
    assert noisy1.item() == noisy2.item() and noisy1.item() != clean.item()


@pytest.mark.parametrize("family", [{}, {"markov_rank": 4, "confidence_head": True}], ids=["dflash", "dspark"])
def test_no_trainable_positions_gives_zero_loss_with_a_graph(family):
    drafter = small_drafter(**family)
    ids, _, feats, lengths = _batch()
    loss, metrics = dflash_loss(drafter, Batch(ids, torch.zeros(2, 20), lengths, target_hidden=feats))
    assert loss.item() == 0.0 and metrics["num_blocks"] == 0.0
    loss.backward()  # every parameter gets a (zero) gradient, as DDP requires
    assert all(p.grad is not None for p in drafter.trainable_parameters())


@pytest.mark.parametrize("change, message", [
    (lambda b: replace(b, input_ids=b.input_ids[0]), r"input_ids must be \(batch, time\)"),
    (lambda b: replace(b, input_ids=b.input_ids.float()), "integer tensor"),
    (lambda b: replace(b, loss_mask=b.loss_mask[:, :5]), "loss_mask shape"),
    (lambda b: replace(b, target_hidden=b.target_hidden[..., :32]), "target_hidden shape"),
    (lambda b: replace(b, target_hidden=None), "no target_hidden"),
    (lambda b: replace(b, lengths=torch.tensor([21, 3])), "lengths"),
    (lambda b: replace(b, lengths=torch.tensor([3])), "lengths shape"),
])
def test_bad_input_is_named(change, message):
    drafter = small_drafter()
    with pytest.raises(ValueError, match=message):
        dflash_loss(drafter, change(_as_batch(_batch())))


def test_bad_settings_are_named():
    drafter = small_drafter()
    with pytest.raises(ValueError, match="gamma"):
        dflash_loss(drafter, _as_batch(_batch()), gamma=0.0)


def test_bfloat16_drafter_over_float32_target_parts():
    drafter = small_drafter().to(torch.bfloat16)
    ids, loss_mask, feats, lengths = _batch()
    loss, _ = dflash_loss(drafter, Batch(ids, loss_mask, lengths, target_hidden=feats.to(torch.bfloat16)),
                          logits_chunk=8)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert drafter.fc.weight.grad.dtype == torch.bfloat16 and drafter.lm_head.weight.dtype == torch.float32


def test_loss_norm_positions_divides_the_weighted_sum_by_the_trained_positions():
    drafter = small_drafter()
    ids, loss_mask, feats, lengths = _batch()
    batch = Batch(ids, loss_mask, lengths, target_hidden=feats)
    by_weights, _ = dflash_loss(drafter, batch, max_anchors=5, gamma=3.0, generator=torch.Generator().manual_seed(1))
    by_positions, metrics = dflash_loss(drafter, batch, max_anchors=5, gamma=3.0, loss_norm="positions",
                                        generator=torch.Generator().manual_seed(1))
    anchors, valid = sample_anchors(loss_mask, lengths, 5, torch.Generator().manual_seed(1))
    _, weights = block_targets(ids, loss_mask, lengths, anchors, valid, drafter.config.block_size, 3.0)
    trained = (weights > 0).sum()
    assert metrics["num_trained_tokens"] == float(trained) and weights.sum() < trained
    torch.testing.assert_close(by_positions, by_weights * weights.sum() / trained)


def test_batch_spread_anchors_follow_the_trained_tokens():
    loss_mask = torch.zeros(3, 64)
    loss_mask[0, 2:60] = 1  # 57 anchor positions
    loss_mask[1, 10:14] = 1  # 3
    loss_mask[2, 30:50] = 1  # 19
    lengths = torch.tensor([64, 64, 64])
    anchors, valid = sample_anchors(loss_mask, lengths, 8, torch.Generator().manual_seed(0), spread="batch")
    counts = valid.sum(1).tolist()
    assert sum(counts) == 24 and counts[1] <= 3 and counts[0] > 8  # 8 x 3 in all, more where more is trained
    for row, ok, mask in zip(anchors, valid, loss_mask):
        a = row[ok]
        assert bool((a.diff() > 0).all()) and bool(mask[a].all()) and bool(mask[a + 1].all())
    small, small_valid = sample_anchors(loss_mask, lengths, 100, torch.Generator().manual_seed(0), spread="batch")
    assert small_valid.sum(1).tolist() == [57, 3, 19]  # a budget above the positions takes them all
