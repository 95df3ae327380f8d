"""Acceptance length by real speculative decoding.

Decoding loop (greedy, as the reference's): prefill the target on the chat-formatted prompt and
take its hidden states at the drafter's layers; then repeat: the anchor is the last emitted
token; the drafter proposes B-1 tokens in one forward (context = target features of every
position strictly before the anchor); the target verifies ``[anchor, drafts]`` in one forward;
the longest prefix of drafts equal to the target's argmax is accepted, plus the target's own
next token. tau = tokens emitted per verify step. The output equals the target's greedy output.

A ``should_stop`` callable is asked before every draft-and-verify step: when it turns true the decoding
ends with :class:`DecodeStopped` (nothing of the prompt is returned), so a cancel or a shutdown waits for
one step, not for the whole generation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from dfp_shared import chat_template

from ..drafter.attention import decode_masks

StopCheck = Callable[[], bool]


class DecodeStopped(Exception):
    """``should_stop`` turned true mid-decoding: the generation was abandoned (no partial result)."""


def check_stop(should_stop: StopCheck | None) -> None:
    """Raise :class:`DecodeStopped` when ``should_stop`` (if any) says so."""
    if should_stop is not None and should_stop():
        raise DecodeStopped()


def target_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """HF ``hidden_states[i + 1]`` (the output of layer i) for each layer id, concatenated: (S, T, K*H)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _has_linear_layers(model) -> bool:
    config = getattr(model.config, "text_config", None) or model.config
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


class _Verifier:
    """Target forwards over a growing sequence: with a cropped KV cache, or by re-running (hybrid targets).

    With no layer ids the forward returns no features (a proposer that reads none, e.g. n-gram lookup)."""

    def __init__(self, target, layer_ids: Sequence[int], use_cache: bool) -> None:
        self.target, self.layer_ids, self.use_cache = target, list(layer_ids), use_cache
        self.cache = None
        if use_cache:
            import inspect

            from transformers import DynamicCache

            self.cache = DynamicCache(config=target.config)
            if hasattr(self.cache, "activate_past_recording"):  # lets linear-attention layers crop too
                self.cache.activate_past_recording()
            params = inspect.signature(target.forward).parameters
            self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def forward(self, seq: torch.Tensor, start: int, keep: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (L, V) and features (L, K*H) of ``seq[start:]`` given ``seq[:start]`` already seen; with ``keep``,
        the logits of only the last ``keep`` positions (the LM head is the costliest part of a small target)."""
        n = seq.shape[0]
        hidden = bool(self.layer_ids)
        if self.use_cache:
            extra = self.cache.get_seq_length() - start
            if extra > 0:
                self.cache.crop(-extra)
            ids, pos = seq[start:][None], torch.arange(start, n, device=seq.device)[None]
            out = self.target(input_ids=ids, position_ids=pos, use_cache=True, output_hidden_states=hidden,
                              logits_to_keep=keep or n - start, **{self.cache_arg: self.cache})
        else:
            out = self.target(input_ids=seq[None], output_hidden_states=hidden, use_cache=False,
                              logits_to_keep=keep or n - start)
        logits = out.logits[0, -(keep or n - start):]
        if not hidden:
            return logits, None
        feats = target_features(out.hidden_states, self.layer_ids)[0, -(n - start):]
        return logits, feats


Proposer = Callable[[torch.Tensor, "torch.Tensor | None", int], torch.Tensor]
"""``propose(seq, context, n)``: at most ``n`` draft tokens to follow ``seq`` (1-D ids, its last token the
anchor); ``context`` holds the target's features of every position before the anchor (None when the
verifier reads no layers)."""


@torch.inference_mode()
def verify_decode(propose: Proposer, target, prompt_ids: torch.Tensor, *, max_new_tokens: int, draft_len: int,
                  layer_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (), use_cache: bool | None = None,
                  whole_blocks: bool = False, should_stop: StopCheck | None = None) -> dict:
    """Greedy draft-and-verify decoding of one prompt (1-D ids) with any proposer: the one harness.

    Each step the proposer drafts up to ``draft_len`` tokens after the anchor (the last emitted token);
    the target verifies ``[anchor, drafts]`` in one forward; the longest prefix of drafts equal to its
    argmax is accepted, plus its own next token, so the output equals the target's greedy output. The
    drafts are cut to the token budget, unless ``whole_blocks`` (as vLLM drafts: the emitted tokens are
    cut, the verified block is not). Per step: ``steps`` (tokens emitted, cut at the budget and at a
    stop token), ``accepted`` (drafts the target accepted, uncut) and ``drafted`` (drafts proposed);
    ``accepted_hist[a]`` counts steps that accepted ``a`` drafts. ``should_stop`` is asked before the
    prefill and every step (:class:`DecodeStopped` when it turns true).
    """
    check_stop(should_stop)
    if use_cache is None:
        use_cache = not _has_linear_layers(target)
    verifier = _Verifier(target, layer_ids, use_cache)
    n_prompt = prompt_ids.shape[0]
    max_len = n_prompt + max_new_tokens
    logits, feats = verifier.forward(prompt_ids, 0, keep=1)
    seq = torch.cat([prompt_ids, logits[-1].argmax().view(1)])  # first token comes from the prefill
    context = feats  # (start, K*H): features of every position before the anchor
    stops = set(int(t) for t in stop_token_ids)
    steps, accepted_per_step, drafted_per_step, hist = [], [], [], [0] * (draft_len + 1)
    stopped = int(seq[-1]) in stops
    while seq.shape[0] < max_len and not stopped:
        check_stop(should_stop)
        start = seq.shape[0] - 1  # anchor position
        room = draft_len if whole_blocks else min(draft_len, max_len - start - 1)
        drafts = propose(seq, context, room)[:room].to(seq.device, torch.long)
        logits, feats = verifier.forward(torch.cat([seq, drafts]), start)
        posterior = logits.argmax(-1)  # (1 + drafts,)
        accepted = int((drafts == posterior[:-1]).long().cumprod(0).sum())
        hist[accepted] += 1
        new = torch.cat([drafts[:accepted], posterior[accepted:accepted + 1]])
        new = new[: max_len - seq.shape[0]]
        for i, tok in enumerate(new.tolist()):
            if tok in stops:
                new, stopped = new[: i + 1], True
                break
        seq = torch.cat([seq, new])
        if context is not None:
            context = torch.cat([context, feats[: new.shape[0]]])  # anchor + accepted drafts are now known
        steps.append(int(new.shape[0]))
        accepted_per_step.append(accepted)
        drafted_per_step.append(int(drafts.shape[0]))
    return {"new_ids": seq[n_prompt:].tolist(), "steps": steps, "accepted": accepted_per_step,
            "drafted": drafted_per_step, "accepted_hist": hist}


def dflash_proposer(drafter) -> Proposer:
    """The drafter as a proposer: one forward over ``[anchor, mask * n]`` with the target's context, then the
    family's :meth:`~dfp_trainer.drafter.model.DFlashDrafter.draft` (DFlash: the argmax over the drafter's
    vocabulary, mapped to target ids; DSpark: that plus its Markov head, left to right; DFlash2: its selector's walk
    over the top-k candidates, left to right)."""
    cfg = drafter.config

    def propose(seq: torch.Tensor, context: torch.Tensor | None, n: int) -> torch.Tensor:
        dev, start = seq.device, seq.shape[0] - 1
        block = torch.full((n + 1,), cfg.mask_token_id, dtype=torch.long, device=dev)
        block[0] = seq[start]
        positions = torch.arange(start, start + n + 1, device=dev)
        ctx_pos = torch.arange(start, device=dev)
        masks = decode_masks(start, ctx_pos, n + 1, cfg.layer_types, cfg.sliding_window)
        hidden = drafter(block[None], positions[None], context[None], ctx_pos, masks)  # (1, n + 1, H)
        return drafter.draft(hidden[0, 1:], block[0])  # the family's drafting (DSpark, DFlash2: left to right)

    return propose


@torch.inference_mode()
def speculative_decode(drafter, target, prompt_ids: torch.Tensor, *, max_new_tokens: int,
                       layer_ids: Sequence[int] | None = None, stop_token_ids: Sequence[int] = (),
                       use_cache: bool | None = None, whole_blocks: bool = False,
                       should_stop: StopCheck | None = None) -> dict:
    """Greedy speculative decoding of one prompt (1-D ids) with a DFlash drafter (block size B: B-1
    drafts per step); returns new token ids, tokens per step and the histogram of accepted drafts."""
    cfg = drafter.config
    layer_ids = list(layer_ids if layer_ids is not None else cfg.target_layer_ids)
    if len(layer_ids) != cfg.num_context_features:
        raise ValueError(f"{len(layer_ids)} layer ids given; the drafter was built for {cfg.num_context_features}")
    return verify_decode(dflash_proposer(drafter), target, prompt_ids, max_new_tokens=max_new_tokens,
                         draft_len=cfg.block_size - 1, layer_ids=layer_ids, stop_token_ids=stop_token_ids,
                         use_cache=use_cache, whole_blocks=whole_blocks, should_stop=should_stop)


def chat_prompt_ids(tokenizer, messages: list[dict], enable_thinking: bool) -> list[int]:
    return chat_template.chat_prompt_ids(tokenizer, messages, enable_thinking=enable_thinking)
