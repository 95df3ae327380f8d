"""Distillation from the target's own distribution: forward KL(p_T || q) at every trained block position.

The output at block position k of a block anchored at ``a`` drafts the token at ``a + k``; the target's
distribution of that token is ``p_T(. | tokens <= a + k - 1)``, its softmax (temperature 1) at sequence position
``a + k - 1``. The target's logits there are ``lm_head(h)``, ``h`` its last layer's output after the final norm:
what Hugging Face reports as ``hidden_states[-1]`` and what the hidden-state source returns for layer ``L - 1``
(:func:`dfp_shared.hidden_states.forward.capture_layers`). So a run that distils asks the source for one more
layer, ``L - 1`` (the teacher), after the drafter's; the batch's ``target_hidden`` then holds ``(K + 1) * H``
columns and the last ``H`` are the teacher's states (:func:`split_teacher`). The cache keeps them like any
layer (``H`` values per token in the target's dtype; the layer ids in its key refuse a cache without them),
and the trainer multiplies them by the target's frozen LM head, in chunks, to get the target's exact logits.

The drafter's distribution ``q`` is the one it drafts from: the LM head's softmax (DSpark: plus its Markov
head's bias of the true previous token, as its cross-entropy is computed; DFlash2: the LM head's, whose top-k
the selector reorders; the selector itself learns from the cross-entropy only).

A pruned draft vocabulary ``D`` covers the mass ``m = p_T(D)`` of the target's distribution; the rest cannot
be drafted. The loss of a position is ``m * KL(p_T|D || q)``, ``p_T|D = p_T / m`` on ``D``: the divergence
from the target's distribution given a draftable token, weighted by how likely a draftable token is, so a
position whose next token the drafter mostly cannot draft weighs little (as the cross-entropy leaves out a
label outside ``D``). Its gradient is that of ``-sum_D p_T log q``. With the whole vocabulary ``m = 1``.

Each position is weighted and masked as the cross-entropy is (decay or D-PACE weights, loss mask, labels
outside ``D`` left out) and normalised by the same sum; ``distill_weight`` ``w`` mixes the two:
``(1 - w) * CE + w * KL``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .vocab import target_ids_of

UNSUPPORTED_TARGET_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Target config fields that change the logits after the LM head: a target with one set cannot be distilled."""


def teacher_layer_ids(num_layers: int, distill: bool, layer_ids: list[int]) -> list[int]:
    """The layers a run asks the source for besides the drafter's ``layer_ids``: the target's last one when it
    distils (ValueError when the drafter reads that layer itself: a source serves each layer once a request)."""
    if not distill:
        return []
    if num_layers - 1 in layer_ids:
        raise ValueError(f"distill_weight / labels target_argmax: the drafter reads the target's last layer ({num_layers - 1}) among its "
                         f"target_layer_ids {list(layer_ids)}, the layer the teacher's logits come from; choose "
                         "earlier layers")
    return [num_layers - 1]


def check_teacher_target(config: dict) -> None:
    """ValueError when the target's logits are not exactly ``lm_head`` of its final-normed last layer."""
    found = [name for name in UNSUPPORTED_TARGET_FIELDS if config.get(name) not in (None, 0, 0.0, 1, 1.0)]
    if found:
        raise ValueError(f"distill_weight / labels target_argmax: the target's logits are not its LM head's alone ({', '.join(found)} "
                         "set), so its last layer's states do not give its distribution")


def split_teacher(target_hidden: torch.Tensor | None, width: int, hidden_size: int,
                  distill_weight: float, required: bool | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The drafter's features (S, T, width) and the teacher's states (S, T, H), or None when the batch has none.

    A batch whose features are ``width + H`` wide carries the teacher in its last ``H`` columns (read only
    when ``distill_weight`` > 0 or the labels are the target's, ``required``); needing them without them is an
    error."""
    if not 0 <= distill_weight <= 1:
        raise ValueError(f"distill_weight must be in [0, 1]; got {distill_weight}")
    if target_hidden is not None and target_hidden.shape[-1] == width + hidden_size:
        return target_hidden[..., :width], target_hidden[..., width:]
    if distill_weight > 0 if required is None else required:
        got = None if target_hidden is None else target_hidden.shape[-1]
        why = f"distill_weight {distill_weight}" if distill_weight > 0 else "the target's labels (target_argmax)"
        raise ValueError(f"{why} needs the target's last layer after the drafter's "
                         f"features: target_hidden of width {width} + {hidden_size}, got {got}")
    return target_hidden, None


def teacher_rows(teacher: torch.Tensor, prev_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The teacher's states (rows, H) of the trained block rows: sequence position ``a + k - 1`` of each.

    ``teacher`` (S, T, H); ``prev_pos`` (S, N*B) the sequence position before each block row."""
    s, q = prev_pos.shape
    h = teacher.shape[-1]
    picked = torch.gather(teacher, 1, prev_pos[:, :, None].expand(s, q, h))  # (S, N*B, H)
    return picked.reshape(s * q, h)[rows]


def teacher_logits(lm_head: torch.nn.Linear, states: torch.Tensor) -> torch.Tensor:
    """The target's float32 logits (rows, V) from its final-normed last-layer states (rows, H)."""
    return lm_head(states.to(lm_head.weight.dtype)).float()


@torch.no_grad()
def argmax_labels(lm_head: torch.nn.Linear, teacher: torch.Tensor, prev_pos: torch.Tensor, labels: torch.Tensor,
                  scored: torch.Tensor, chunk: int) -> torch.Tensor:
    """``labels`` (S*N*B,) with each scored block row's replaced by the target's greedy next token there: the
    argmax of its logits at the sequence position before the row (``teacher`` (S, T, H), ``prev_pos`` (S, N*B),
    ``scored`` (S, N, B)), ``chunk`` rows of logits at a time."""
    rows = scored.reshape(-1).nonzero().squeeze(1)
    states = teacher_rows(teacher, prev_pos, rows)
    out = labels.clone()
    for i in range(0, rows.numel(), chunk):
        out[rows[i:i + chunk]] = teacher_logits(lm_head, states[i:i + chunk]).argmax(-1)
    return out


def drafter_logits(model, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
    """The float32 logits (rows, V_d) the drafter drafts from (a DSpark drafter's with its Markov bias)."""
    serving = getattr(model, "serving_logits", None)
    return serving(hidden, prev_ids) if serving is not None else model.logits(hidden).float()


def _chunk_kl(hidden: torch.Tensor, teacher: torch.Tensor, prev_ids: torch.Tensor, model) -> torch.Tensor:
    """Per-row ``m * KL(p_T|D || q)`` (rows,) of drafter states and teacher states, both (rows, H).

    Written as ``sum_D p log p_T|D - sum_D p log q`` with ``p = m * p_T|D``: the first term is a constant
    (no graph)."""
    with torch.no_grad():
        logits = teacher_logits(model.target_lm_head, teacher)  # (rows, V)
        t_logp = torch._log_softmax(logits, -1, False, out=logits)  # in place: log p_T
        if model.config.pruned:
            t_logp = t_logp[:, target_ids_of(model.d2t)]  # (rows, V_d): log p_T on the draft vocabulary
        p = t_logp.exp()  # m * p_T|D
        if model.config.pruned:
            t_logp.sub_(torch.logsumexp(t_logp, dim=-1, keepdim=True))  # log p_T|D = log p_T - log m
        constant = (p * t_logp).sum(-1)  # (rows,)
        del logits, t_logp
    q_logp = F.log_softmax(drafter_logits(model, hidden, prev_ids), dim=-1)
    return constant - (p * q_logp).sum(-1)


def distill_rows(model, hidden: torch.Tensor, teacher: torch.Tensor, prev_ids: torch.Tensor,
                 logits_chunk: int) -> torch.Tensor:
    """Per-row distillation loss (rows,) in chunks of ``logits_chunk`` rows; with several chunks each one's
    logits are recomputed in the backward pass, so only one chunk's are alive at a time."""
    parts = []
    for start in range(0, hidden.shape[0], logits_chunk):
        args = (hidden[start:start + logits_chunk], teacher[start:start + logits_chunk],
                prev_ids[start:start + logits_chunk], model)
        if torch.is_grad_enabled() and hidden.requires_grad and hidden.shape[0] > logits_chunk:
            parts.append(checkpoint(_chunk_kl, *args, use_reentrant=False))
        else:
            parts.append(_chunk_kl(*args))
    return torch.cat(parts)


def mix_distill(ce_loss: torch.Tensor, model, hidden: torch.Tensor, rows: torch.Tensor, teacher: torch.Tensor | None,
                prev_pos: torch.Tensor, prev_ids: torch.Tensor, row_w: torch.Tensor, norm: torch.Tensor,
                distill_weight: float, logits_chunk: int) -> tuple[torch.Tensor, dict]:
    """``(1 - w) * ce_loss + w * KL`` with the KL weighted and normalised as the cross-entropy, and
    ``{"distill_kl": KL}`` for the metrics.

    ``hidden`` (S*N*B, H) the drafter's states of every block row, ``rows`` the trained ones, ``prev_ids``
    (S*N*B,) the true token before each, ``row_w`` (rows,) their weights, ``norm`` the weights' normaliser.
    At weight 0 (or without a teacher) ``ce_loss`` and no metrics, nothing computed."""
    if not distill_weight or teacher is None:
        return ce_loss, {}
    kl = distill_rows(model, hidden[rows], teacher_rows(teacher, prev_pos, rows), prev_ids[rows], logits_chunk)
    kl_loss = (kl * row_w).sum() / norm
    return (1 - distill_weight) * ce_loss + distill_weight * kl_loss, {"distill_kl": float(kl_loss.detach())}
