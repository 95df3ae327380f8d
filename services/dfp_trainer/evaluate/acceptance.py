"""τ of a drafter over prompts: speculative decoding of the prompts (:mod:`.batched`, several at once) summed up."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from dfp_shared.models import stop_tokens

from .batched import speculative_decode_batch
from .decode import chat_prompt_ids


def acceptance(drafter, target_model, prompts: Iterable[torch.Tensor], *, max_new_tokens: int,
               stop_token_ids: Sequence[int], layer_ids: Sequence[int] | None = None, batch_size: int = 8) -> dict:
    """Tau (tokens emitted per verify step) over token-id prompts by speculative decoding, ``batch_size`` at a
    time (the counts of one at a time), with the steps, new tokens and tau of each prompt and the histogram of
    accepted drafts."""
    was_training = drafter.training
    drafter.eval()
    dev = drafter.fc.weight.device
    per_prompt, hist, total_tokens, total_steps = [], [0] * drafter.config.block_size, 0, 0
    try:
        outs, _ = speculative_decode_batch(drafter, target_model, [ids.to(dev) for ids in prompts],
                                           max_new_tokens=max_new_tokens, batch_size=batch_size, layer_ids=layer_ids,
                                           stop_token_ids=stop_token_ids)
    finally:
        drafter.train(was_training)
    for out in outs:
        tokens, steps = sum(out["steps"]), len(out["steps"])
        per_prompt.append({"tau": tokens / steps if steps else 0.0, "steps": steps, "new_tokens": tokens})
        hist = [a + b for a, b in zip(hist, out["accepted_hist"])]
        total_tokens, total_steps = total_tokens + tokens, total_steps + steps
    return {"tau": total_tokens / total_steps if total_steps else 0.0, "per_prompt": per_prompt,
            "accepted_hist": hist, "steps": total_steps, "new_tokens": total_tokens}


def acceptance_length(drafter, target_model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int,
                      enable_thinking: bool, layer_ids: Sequence[int] | None = None,
                      stop_token_ids: Sequence[int] | None = None) -> dict:
    """Mean tokens emitted per verify step over chat prompts (the acceptance length tau), and details."""
    if not prompts:
        raise ValueError("no evaluation prompts")
    stops = stop_tokens.stop_token_ids(tokenizer) if stop_token_ids is None else list(stop_token_ids)
    ids = (torch.tensor(chat_prompt_ids(tokenizer, messages, enable_thinking), dtype=torch.long) for messages in prompts)
    result = acceptance(drafter, target_model, ids, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                        layer_ids=layer_ids)
    return {**result, "enable_thinking": enable_thinking}
