"""τ by replay: what greedy speculative decoding with a drafter would count, from the target's greedy output.

Greedy speculative decoding emits the target's greedy output whatever the drafter drafts; the drafter decides
only how many verify steps it takes. A step anchored at position q (the last emitted token) drafts from the
target's features of every position before q and the anchor's token, and accepts the longest prefix of its drafts
equal to the greedy output after q. So with the greedy output known (from any decoding of the same target, e.g.
n-gram speculation's, which the evaluate job runs anyway), one target forward over prompt + output gives the
features of every position, one drafter forward drafts at every anchor at once (the blocks side by side, as
training lays them out), and walking the output from anchor to anchor (next anchor: after the accepted drafts and
the target's own token) gives the steps, the accepted drafts and τ counted exactly as
:mod:`.decode`'s ``verify_decode`` with ``whole_blocks`` counts them (:func:`~.tau.tau_figures` reads both).

The drafts of each anchor are the family's own (:meth:`~dfp_trainer.drafter.model.DFlashDrafter.draft`: DSpark and
DFlash2 walk left to right), so every family replays. What differs from decoding is only arithmetic: the target's
features come from one forward over the whole sequence instead of a KV cache grown step by step, and the drafter's
blocks share one attention call, so a draft whose two best tokens are within float noise of each other may flip
(the batched decoder re-decodes such rows alone; replay does not). Drafts past the output's end are unknown and
count as not accepted, so ``tau`` (cut at the budget) is exact while ``tau_vllm`` (whole blocks) may count a
little less near the end. The cost is one target forward of prompt + output and one drafter forward of ``output``
blocks per prompt, against one target forward per step (and a drafter forward) when decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..drafter.attention import training_masks
from .decode import StopCheck, check_stop, target_features


@torch.inference_mode()
def sequence_features(target, seq: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """(1, T, K*H) the target's features at ``layer_ids`` of every position of the 1-D ``seq``, one forward."""
    out = target(input_ids=seq[None], output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return target_features(out.hidden_states, layer_ids)


@torch.inference_mode()
def anchor_drafts(drafter, target, prompt: torch.Tensor, output: torch.Tensor, layer_ids: Sequence[int],
                  chunk: int = 64, feats: torch.Tensor | None = None) -> torch.Tensor:
    """(L, B-1) the drafter's drafts at every anchor of ``output`` (L tokens after the 1-D ``prompt``): anchor
    ``i`` is output token ``i`` at position ``len(prompt) + i``, drafted from the target's features of every
    position before it (``feats``, :func:`sequence_features` of prompt + output, computed when not given);
    ``chunk`` anchors per drafter forward."""
    cfg = drafter.config
    b, dev = cfg.block_size, prompt.device
    seq = torch.cat([prompt, output])
    if feats is None:
        feats = sequence_features(target, seq, layer_ids)  # (1, T, K*H)
    n_prompt, n_out = prompt.shape[0], output.shape[0]
    t = seq.shape[0]
    drafts = torch.empty(n_out, b - 1, dtype=torch.long, device=dev)
    for start in range(0, n_out, chunk):
        anchors = torch.arange(n_prompt + start, n_prompt + min(start + chunk, n_out), device=dev)[None]  # (1, N)
        n = anchors.shape[1]
        block = torch.full((1, n, b), cfg.mask_token_id, dtype=torch.long, device=dev)
        block[:, :, 0] = seq[anchors]
        positions = anchors[:, :, None] + torch.arange(b, device=dev)
        masks = training_masks(anchors, b, t, cfg.layer_types, cfg.sliding_window, "sdpa")
        hidden = drafter(block.view(1, n * b), positions.view(1, n * b), feats, torch.arange(t, device=dev), masks)
        hidden = hidden.view(n, b, -1)
        for j in range(n):
            drafts[start + j] = drafter.draft(hidden[j, 1:], block[0, j, 0])
    return drafts


def walk(drafts: torch.Tensor, output: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int]) -> dict:
    """The decoding's steps over the greedy ``output`` given each anchor's ``drafts`` (L, B-1): a run record as
    ``verify_decode`` returns it (``steps`` emitted tokens cut at the budget and a stop token, ``accepted``,
    ``drafted``, ``accepted_hist``)."""
    draft_len = drafts.shape[1]
    out, stops = list(output), set(int(t) for t in stop_token_ids)
    steps, accepted_per_step, drafted_per_step, hist = [], [], [], [0] * (draft_len + 1)
    emitted = 1  # the prefill's token
    stopped = bool(out) and out[0] in stops
    rows = drafts.tolist()
    while emitted < min(max_new_tokens, len(out)) and not stopped:
        anchor = emitted - 1
        accepted = 0
        for k, tok in enumerate(rows[anchor], start=1):
            if anchor + k >= len(out) or out[anchor + k] != tok:
                break
            accepted += 1
        hist[accepted] += 1
        new = out[emitted:min(emitted + accepted + 1, max_new_tokens)]
        for i, tok in enumerate(new):
            if tok in stops:
                new, stopped = new[: i + 1], True
                break
        emitted += len(new)
        steps.append(len(new))
        accepted_per_step.append(accepted)
        drafted_per_step.append(draft_len)
    return {"new_ids": out[:emitted], "steps": steps, "accepted": accepted_per_step, "drafted": drafted_per_step,
            "accepted_hist": hist}


def replay_decode(drafter, target, prompts: Sequence[torch.Tensor], outputs: Sequence[Sequence[int]], *,
                  max_new_tokens: int, stop_token_ids: Sequence[int] = (), layer_ids: Sequence[int] | None = None,
                  should_stop: StopCheck | None = None, features: Sequence[torch.Tensor] | None = None) -> list[dict]:
    """Per prompt, the run record greedy speculative decoding with ``drafter`` would give (as
    :func:`~.decode.speculative_decode` with ``whole_blocks``), from the target's greedy ``outputs`` (new token ids
    of at least ``min(max_new_tokens, up to a stop token)``); ``features`` (optional, per prompt): the target's
    :func:`sequence_features` of prompt + output cut to ``max_new_tokens``, shared by drafters reading the same
    layers; ``should_stop`` is asked before each prompt."""
    layer_ids = list(layer_ids if layer_ids is not None else drafter.config.target_layer_ids)
    runs = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        check_stop(should_stop)
        out = torch.as_tensor(list(output)[:max_new_tokens], dtype=torch.long, device=prompt.device)
        drafts = anchor_drafts(drafter, target, prompt, out, layer_ids, feats=None if features is None else features[i])
        runs.append(walk(drafts, out.tolist(), max_new_tokens, stop_token_ids))
    return runs
