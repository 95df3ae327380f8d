"""The DFlash training objective: anchor sampling, block attention, decayed masked cross-entropy.

For each sequence, up to ``max_anchors`` anchor positions ``a`` are sampled among those where the
anchor and the next token are trained (``loss_mask[a] and loss_mask[a + 1]``, ``a + 1 < length``).
Each anchor opens a block of B tokens: the anchor token at block position 0, the mask token at
1..B-1, position ids ``a..a+B-1``. The block sees the projected target features of positions
strictly before ``a`` and its own whole block. The output at block position k (1..B-1) is trained
to be the sequence's token at ``a + k`` (no shift), weighted ``exp(-(k-1)/gamma)``, masked by the
loss mask at ``a + k`` and by ``a + k < length``; the loss is normalised by the weights (``loss_norm="positions"``:
by the number of trained positions). ``anchor_spread="batch"`` draws ``max_anchors`` times the sequences anchors
uniformly over the whole batch, so a sequence with more trained tokens gets more. Logits go
through the frozen LM head in chunks; with several chunks each is recomputed in the backward pass,
so only one chunk of logits is alive at a time.

``loss="dpace"`` (D-PACE, dynamic position-aware cross-entropy) replaces the fixed decay by weights
from the drafter's own current confidence in each label, ``q_k = exp(-CE_k)`` (detached): smoothed
``r_k = (1 - alpha) q_k + alpha``, position k weighs ``w_k = sum_{m >= k} prod_{i <= m} r_i``, the
derivative of the block's expected accepted length ``sum_m prod_{i <= m} q_i`` with respect to
``log q_k`` (with the smoothing). A position that is not trained stops the products, as it stops
acceptance. The weighted sum is normalised by the number of blocks with a trained position, so
the credit mass (expected accepted length) is kept rather than divided out.

A drafter with a pruned vocabulary (:mod:`.vocab`) is trained on draft ids through its own head; a trained
position whose label is outside its vocabulary is left out of the loss (and stops D-PACE's products, as it
stops acceptance), scored as wrong in the accuracies, and counted as ``out_of_vocab``.
"""

from __future__ import annotations

from typing import get_args

import torch
from dfp_shared.specs.train import LabelSource, LossKind
from torch.utils.checkpoint import checkpoint

from .attention import training_masks
from .batch import Batch
from .distill import argmax_labels, mix_distill, split_teacher
from .wrappers import unwrap


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, max_anchors: int,
                   generator: torch.Generator | None = None, spread: str = "sequence") -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor positions (S, N) sorted ascending and their validity (S, N); N = most valid anchors in a row.

    ``spread="batch"``: up to ``max_anchors * S`` anchors drawn uniformly over the whole batch's anchor positions
    (a row with more trained tokens gets more), not ``max_anchors`` in each row."""
    s, t = loss_mask.shape
    dev = loss_mask.device
    trained = loss_mask.bool()
    pos = torch.arange(t, device=dev)
    ok = torch.zeros_like(trained)
    ok[:, :-1] = trained[:, :-1] & trained[:, 1:]
    ok &= (pos[None, :] + 1) < lengths.to(dev)[:, None]
    gen_dev = generator.device if generator is not None else torch.device("cpu")
    scores = torch.rand((s, t), generator=generator, device=gen_dev).to(dev)
    scores = torch.where(ok, scores, torch.full_like(scores, -1.0))
    k = min(max_anchors, t)
    if spread == "batch" and s:
        chosen = torch.zeros(s * t, dtype=torch.bool, device=dev)
        chosen[torch.topk(scores.reshape(-1), min(max_anchors * s, s * t)).indices] = True
        scores = torch.where(chosen.view(s, t), scores, torch.full_like(scores, -1.0))
        k = t
    top, idx = torch.topk(scores, k, dim=1)
    valid = top >= 0
    n = int(valid.sum(1).max().item()) if s else 0
    idx = torch.where(valid, idx, torch.full_like(idx, t))  # invalid ones sort last
    idx, order = torch.sort(idx, dim=1)
    valid = torch.gather(valid, 1, order)
    idx, valid = idx[:, :n], valid[:, :n]
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                  valid: torch.Tensor, block_size: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels (S, N, B) and loss weights (S, N, B) of the blocks; weight 0 where not trained."""
    s, t = input_ids.shape
    k = torch.arange(block_size, device=input_ids.device)
    pos = anchors[:, :, None] + k  # (S, N, B)
    inside = (pos < lengths.to(pos.device)[:, None, None]) & (pos < t)
    safe = pos.clamp(max=t - 1).reshape(s, -1)
    labels = torch.gather(input_ids, 1, safe).view_as(pos)
    mask = torch.gather(loss_mask.bool(), 1, safe).view_as(pos) & inside & valid[:, :, None] & (k > 0)
    decay = torch.exp(-(k.float() - 1).clamp(min=0) / gamma)
    return labels, mask.float() * decay


LOSSES = get_args(LossKind)
LABEL_SOURCES = get_args(LabelSource)


def dpace_weights(ce: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights (blocks, B) from per-position cross-entropy and trained flags, both (blocks, B).

    Position 0 (the anchor) and untrained positions weigh 0; an untrained position also zeroes the
    products of the positions after it."""
    conf = torch.where(trained, (1 - alpha) * torch.exp(-ce) + alpha, torch.zeros_like(ce))
    prefix = torch.cumprod(conf[:, 1:], dim=1)  # prod_{i <= m} r_i for m = 1..B-1 (the anchor is given)
    suffix = prefix.flip(1).cumsum(1).flip(1)  # sum_{m >= k}
    weights = torch.zeros_like(ce)
    weights[:, 1:] = suffix
    return weights * trained


def _chunk_loss(hidden: torch.Tensor, labels: torch.Tensor, prev_ids: torch.Tensor, model: torch.nn.Module):
    return model.head_loss(hidden, labels, prev_ids)  # (chunk,) cross-entropy, argmax hits, the family's extra loss


def dflash_loss(drafter, batch: Batch, *, max_anchors: int = 512, gamma: float = 7.0, noise_std: float = 0.0,
                generator: torch.Generator | None = None, logits_chunk: int = 4096,
                attention_backend: str = "auto", loss: str = "decay",
                dpace_alpha: float = 0.5, confidence_weight: float = 0.0,
                distill_weight: float = 0.0, loss_norm: str = "weights",
                anchor_spread: str = "sequence", label_source: str = "data") -> tuple[torch.Tensor, dict]:
    """Weighted block cross-entropy of a batch and its metrics (``loss``: one of :data:`LOSSES`).

    The batch's input_ids (S, T) integer, loss_mask (S, T) 0/1, target_hidden (S, T, K*H) = target
    features of every position, lengths (S,) valid tokens per row. ``generator`` drives anchor sampling
    and feature noise. Metrics are plain floats (and lists of floats); the ``*_sum``/``*_count`` entries
    add up across batches and ranks.

    The rows go through the drafter's ``head_loss``: a DSpark drafter's (:mod:`.families.dspark`) biases each row's
    logits by its Markov head of the previous true token (teacher forcing) and adds its confidence head's
    binary cross-entropy, averaged over the trained rows and weighted ``confidence_weight``, to the loss.
    ``distill_weight`` w > 0: ``(1 - w) * CE + w * KL`` from the target's distribution (:mod:`.distill`).
    ``label_source`` ``target_argmax``: each position's label is the target's greedy token there, from the same
    teacher states (:func:`~.distill.argmax_labels`); the accuracies then count agreement with the target.
    """
    model = unwrap(drafter)
    cfg = model.config
    b = cfg.block_size
    input_ids, loss_mask, target_hidden, lengths = batch.input_ids, batch.loss_mask, batch.target_hidden, batch.lengths
    target_hidden, teacher = split_teacher(target_hidden, model.fc.in_features, cfg.hidden_size, distill_weight,
                                           required=distill_weight > 0 or label_source == "target_argmax")
    _check_inputs(input_ids, loss_mask, target_hidden, lengths, model.fc.in_features)
    if gamma <= 0 or logits_chunk < 1 or max_anchors < 1:
        raise ValueError(f"gamma ({gamma}), logits_chunk ({logits_chunk}) and max_anchors ({max_anchors}) "
                         f"must be positive")
    if loss not in LOSSES or not 0 < dpace_alpha <= 1 or label_source not in LABEL_SOURCES:
        raise ValueError(f"loss must be one of {LOSSES} (got {loss!r}), dpace_alpha in (0, 1] (got {dpace_alpha}) "
                         f"and label_source one of {LABEL_SOURCES} (got {label_source!r})")
    input_ids = input_ids.long()
    s, t = input_ids.shape
    dev = input_ids.device
    anchors, valid = sample_anchors(loss_mask, lengths, max_anchors, generator, anchor_spread)
    if anchors.shape[1] == 0:  # nothing to train: one inert block keeps the forward (and DDP) going
        anchors = torch.zeros(s, 1, dtype=torch.long, device=dev)
        valid = torch.zeros(s, 1, dtype=torch.bool, device=dev)
    n = anchors.shape[1]
    labels, weights = block_targets(input_ids, loss_mask, lengths, anchors, valid, b, gamma)

    block_ids, positions, target_hidden = _blocks(input_ids, anchors, cfg.mask_token_id, b, target_hidden, noise_std,
                                                  generator)

    scored = weights > 0  # (S, N, B) trained positions: the accuracies count them all
    flat_labels, out_of_vocab = labels.reshape(-1), 0.0
    prev_pos = (positions - 1).clamp(min=0, max=t - 1).reshape(s, -1)  # teacher forcing: the true token before
    flat_prev = torch.gather(input_ids, 1, prev_pos).reshape(-1)
    if label_source == "target_argmax":  # the target's greedy token wherever a position is trained
        flat_labels = argmax_labels(model.target_lm_head, teacher, prev_pos, flat_labels, scored, logits_chunk)
    label_map = model.label_map()
    if label_map is not None:  # draft ids; positions without one cannot be drafted right: no loss there
        flat_labels = label_map[flat_labels]
        weights = weights * (flat_labels >= 0).view_as(weights)
        out_of_vocab = float((scored & (weights == 0)).sum())
        flat_labels = flat_labels.clamp(min=0)
    flat_w = weights.reshape(-1)
    rows = flat_w.nonzero().squeeze(1)
    masks = training_masks(anchors, b, t, cfg.layer_types, cfg.sliding_window, attention_backend)
    hidden = drafter(block_ids.view(s, n * b), positions.view(s, n * b), target_hidden,
                     torch.arange(t, device=dev), masks)  # (S, N*B, H)
    if rows.numel() == 0:  # a zero loss that still reaches every parameter (DDP expects all gradients)
        blocks = scored.view(s * n, b).float() if out_of_vocab else torch.zeros(0, b, device=dev)
        zero = sum((p.sum() for p in model.trainable_parameters()), hidden.sum()) * 0.0  # a family's heads too
        return zero, {**_metrics(0.0, 0.0, torch.zeros_like(blocks), blocks, 0, b, out_of_vocab), "confidence_bce": 0.0}
    hidden = hidden.reshape(s * n * b, -1)
    ce_rows, extra, correct = _row_losses(model, hidden, rows, flat_labels, flat_prev, flat_w, logits_chunk)
    row_w, norm = _row_weights(ce_rows, flat_w, rows, (weights > 0).view(s * n, b), loss, dpace_alpha, loss_norm)
    value = (ce_rows * row_w).sum() / norm
    value, distilled = mix_distill(value, model, hidden, rows, teacher, prev_pos, flat_prev, row_w, norm,
                                   distill_weight, logits_chunk)  # the cross-entropy alone at weight 0
    confidence_bce = extra / rows.numel()
    if confidence_weight:
        value = value + confidence_weight * confidence_bce
    metrics = _metrics(float(value.detach()), float(norm), correct.view(s * n, b), scored.view(s * n, b).float(),
                       int(valid.sum()), b, out_of_vocab)
    return value, {**metrics, "confidence_bce": float(confidence_bce.detach()), **distilled}


def _row_weights(ce_rows: torch.Tensor, flat_w: torch.Tensor, rows: torch.Tensor, trained: torch.Tensor, loss: str,
                 dpace_alpha: float, loss_norm: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The trained rows' loss weights and the loss's normaliser: D-PACE's (normalised by the trained blocks), or
    the decay weights, normalised by their sum (``loss_norm="weights"``) or by the trained positions."""
    if loss == "dpace":
        full_ce = torch.zeros_like(flat_w)
        full_ce[rows] = ce_rows.detach()
        row_w = dpace_weights(full_ce.view_as(trained), trained, dpace_alpha).reshape(-1)[rows]
        return row_w, trained.any(1).sum().to(row_w.dtype)
    row_w = flat_w[rows]
    if loss_norm == "weights":
        return row_w, flat_w.sum()
    return row_w, torch.tensor(float(rows.numel()), device=flat_w.device)


def _blocks(input_ids: torch.Tensor, anchors: torch.Tensor, mask_token_id: int, b: int, target_hidden: torch.Tensor,
            noise_std: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks' token ids (S, N, B: the anchor, then masks), their positions (S, N, B), and the target features
    with the training noise added."""
    s, n = anchors.shape
    dev = input_ids.device
    block_ids = torch.full((s, n, b), mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    positions = anchors[:, :, None] + torch.arange(b, device=dev)  # (S, N, B)
    if noise_std > 0:
        gen_dev = generator.device if generator is not None else torch.device("cpu")
        noise = torch.randn(target_hidden.shape, generator=generator, device=gen_dev, dtype=torch.float32)
        target_hidden = target_hidden + (noise_std * noise).to(dev, target_hidden.dtype)
    return block_ids, positions, target_hidden


def _row_losses(model, hidden: torch.Tensor, rows: torch.Tensor, flat_labels: torch.Tensor, flat_prev: torch.Tensor,
                flat_w: torch.Tensor, logits_chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trained rows' cross-entropy, the family's extra loss summed, and each row's argmax hit, ``logits_chunk``
    rows at a time (recomputed in the backward when there are more)."""
    ce_parts, extra = [], hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros_like(flat_w)
    for start in range(0, rows.numel(), logits_chunk):
        r = rows[start:start + logits_chunk]
        args = (hidden[r], flat_labels[r], flat_prev[r], model)
        if torch.is_grad_enabled() and hidden.requires_grad and rows.numel() > logits_chunk:
            ce, ok, more = checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            ce, ok, more = _chunk_loss(*args)
        ce_parts.append(ce)
        extra = extra + more
        correct[r] = ok.detach()
    return torch.cat(ce_parts), extra, correct


def _metrics(loss: float, weight_sum: float, correct: torch.Tensor, trained: torch.Tensor, num_blocks: int,
             b: int, out_of_vocab: float = 0.0) -> dict:
    """Accuracy overall and per block position 1..B-1, and the expected accepted length of the blocks."""
    correct = correct * trained
    pos_correct = correct[:, 1:].sum(0).tolist() if correct.numel() else [0.0] * (b - 1)
    pos_count = trained[:, 1:].sum(0).tolist() if trained.numel() else [0.0] * (b - 1)
    # accepted drafts of a block = run of correct predictions from position 1 (untrained positions stop it)
    accepted = correct[:, 1:].cumprod(1).sum(1) if correct.numel() else torch.zeros(0)
    num_correct, num_tokens = float(correct.sum()), float(trained.sum())
    return {
        "loss": loss,
        "accuracy": num_correct / num_tokens if num_tokens else 0.0,
        "per_position_accuracy": [c / n if n else 0.0 for c, n in zip(pos_correct, pos_count)],
        "num_blocks": float(num_blocks),
        "num_trained_tokens": num_tokens,
        "mean_accepted": float(accepted.float().mean()) + 1.0 if accepted.numel() else 0.0,
        "correct_sum": num_correct,
        "weight_sum": weight_sum,
        "loss_sum": loss * weight_sum,
        "accepted_sum": float(accepted.sum()) if accepted.numel() else 0.0,
        "per_position_correct": [float(c) for c in pos_correct],
        "per_position_count": [float(n) for n in pos_count],
        "out_of_vocab": out_of_vocab,
    }


def _check_inputs(input_ids, loss_mask, target_hidden, lengths, width: int) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, time); got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer tensor; got {input_ids.dtype}")
    if loss_mask.shape != input_ids.shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} differs from input_ids {tuple(input_ids.shape)}")
    if target_hidden is None:
        raise ValueError("the batch has no target_hidden (the target features of its positions)")
    if target_hidden.shape[:2] != input_ids.shape or target_hidden.shape[-1] != width:
        raise ValueError(f"target_hidden shape {tuple(target_hidden.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)} and feature width {width}")
    if lengths.shape != input_ids.shape[:1]:
        raise ValueError(f"lengths shape {tuple(lengths.shape)} does not match batch size {input_ids.shape[0]}")
    if bool((lengths > input_ids.shape[1]).any()) or bool((lengths < 0).any()):
        raise ValueError(f"lengths {lengths.tolist()} outside 0..{input_ids.shape[1]}")
