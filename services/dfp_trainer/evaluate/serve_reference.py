"""What a serving engine must reproduce for an exported drafter: plain greedy outputs and acceptance counts.

For chat prompts rendered with the target's chat template in the given thinking mode, it gives each
prompt's token ids, the target's plain greedy continuation (transformers ``generate``), and the
project's speculative decoding with the exported drafter, counted two ways: the project's τ (tokens
emitted per verify step, last block cut at the token budget) and the count of an engine that verifies
whole blocks (vLLM: drafts, accepted drafts per block position, 1 + accepted / drafts).
"""

from __future__ import annotations

import os

import torch
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.models.stop_tokens import stop_token_ids
from dfp_shared.models.tokenizer_assets import load_tokenizer

from ..drafter.load import load_exported
from ..drafter.target_parts import load_target_parts
from .decode import chat_prompt_ids, speculative_decode


def _trim_stop(ids: list[int], stops: set[int]) -> list[int]:
    for i, tok in enumerate(ids):
        if tok in stops:
            return ids[:i + 1]
    return ids


def whole_block_counts(hists: list[list[int]]) -> dict:
    """Drafts, accepted drafts, accepted per position and acceptance length from per-prompt histograms
    of accepted drafts per verify step (``hist[k]``: steps that accepted exactly k drafts)."""
    width = max(len(h) for h in hists) if hists else 0
    total = [sum(h[k] for h in hists if k < len(h)) for k in range(width)]
    drafts = sum(total)
    accepted = sum(k * n for k, n in enumerate(total))
    per_position = [sum(total[k] for k in range(i + 1, width)) for i in range(width - 1)]
    return {"drafts": drafts, "accepted": accepted, "per_position": per_position,
            "acceptance_length": 1.0 + accepted / drafts if drafts else 0.0}


@torch.inference_mode()
def reference_decode(target_dir: str | os.PathLike, drafter_dir: str | os.PathLike, prompts: list[list[dict]], *,
                     max_new_tokens: int, enable_thinking: bool) -> dict:
    """Per prompt: ``prompt_ids``, ``greedy_ids`` (plain greedy), ``speculative_ids`` and the acceptance
    counts; totals: ``tau`` (the project's count) and ``whole_blocks`` (:func:`whole_block_counts`)."""
    tok = load_tokenizer(target_dir)
    target = load_causal_lm(str(target_dir), device="cpu", dtype="float32")
    parts = load_target_parts(target_dir)
    drafter = load_exported(drafter_dir, parts.embed_tokens, parts.lm_head, device="cpu").float().eval()
    stops = stop_token_ids(tok, getattr(target.generation_config, "eos_token_id", None))
    rows, cut_tokens, cut_steps, hists = [], 0, 0, []
    for messages in prompts:
        prompt = chat_prompt_ids(tok, messages, enable_thinking)
        ids = torch.tensor(prompt, dtype=torch.long)
        out = target.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=stops, pad_token_id=tok.pad_token_id)
        greedy = _trim_stop(out[0, len(prompt):].tolist(), set(stops))
        cut = speculative_decode(drafter, target, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops)
        full = speculative_decode(drafter, target, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                                  whole_blocks=True)
        cut_tokens, cut_steps = cut_tokens + sum(cut["steps"]), cut_steps + len(cut["steps"])
        hists.append(full["accepted_hist"])
        rows.append({"prompt_ids": prompt, "greedy_ids": greedy, "speculative_ids": full["new_ids"],
                     "tau": sum(cut["steps"]) / len(cut["steps"]) if cut["steps"] else 0.0,
                     "whole_blocks": whole_block_counts([full["accepted_hist"]])})
    return {"prompts": rows, "tau": cut_tokens / cut_steps if cut_steps else 0.0, "steps": cut_steps,
            "whole_blocks": whole_block_counts(hists), "block_size": drafter.config.block_size,
            "stop_token_ids": stops, "enable_thinking": enable_thinking}
