"""The pruned draft vocabulary a run chooses, from its training data's statistics (the ids and their mapping:
:mod:`dfp_trainer.drafter.vocab`).

* **Choice** (:func:`choose_draft_vocab`): the tokens the chat template writes and the stop tokens
  (:func:`required_token_ids`) always, then the most frequent trained target tokens of the training samples
  (:func:`trained_token_counts`: the loss-masked tokens, which are exactly the objective's labels), ties to
  the lower id. A size above the target's rows, or too small for the required tokens, is refused.
* **Coverage** (:func:`coverage`): how much of the trained tokens the chosen vocabulary covers.
"""

from __future__ import annotations

import torch
from dfp_shared import chat_template
from dfp_shared.models import stop_tokens

# a turn the template renders in full: its added tokens are those a served answer can contain
_PROBE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]


class VocabError(ValueError):
    """The draft vocabulary asked for cannot be built (too many rows, too few for the required tokens)."""


def required_token_ids(tokenizer, enable_thinking: bool) -> list[int]:
    """Sorted ids every draft vocabulary keeps: the stop tokens (eos, ``<|im_end|>``, ...) and every added
    token the chat template writes in a conversation with a reasoning turn (``<think>``, ``</think>``,
    ``<|im_start|>``, ... where the template has them), in the drafter's thinking mode."""
    text = chat_template.render_chat(tokenizer, _PROBE, enable_thinking=enable_thinking)
    written = {index for index, added in tokenizer.added_tokens_decoder.items() if added.content in text}
    return sorted(written | set(stop_tokens.stop_token_ids(tokenizer)))


def trained_token_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor,
                         samples: torch.Tensor, vocab_size: int, max_length: int) -> torch.Tensor:
    """(vocab_size,) int64: how often each token is a trained (loss-masked) token of ``samples``, within each
    sample's first ``max_length`` tokens (what training reads). Flat dataset tensors, ``offsets`` (S+1,)."""
    starts, lengths = offsets[:-1][samples], (offsets[1:] - offsets[:-1])[samples].clamp(max=max_length)
    edges = torch.zeros(input_ids.numel() + 1, dtype=torch.int64)  # +1 where a read span opens, -1 where it ends
    edges.index_add_(0, starts, torch.ones_like(starts))
    edges.index_add_(0, starts + lengths, -torch.ones_like(starts))
    read = edges.cumsum(0)[:-1] > 0  # (tokens,) inside a chosen sample's first max_length tokens
    ids = input_ids[read & loss_mask.bool()].long()
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise VocabError(f"the dataset holds token id {int(ids.max())}, outside the target's {vocab_size} rows")
    return torch.bincount(ids, minlength=vocab_size)


def choose_draft_vocab(counts: torch.Tensor, size: int, required: list[int]) -> torch.Tensor:
    """The target ids (size,) int64, ascending, of a draft vocabulary of ``size`` tokens: ``required`` first,
    then by ``counts`` (ties to the lower id)."""
    vocab_size = counts.numel()
    if size > vocab_size:
        raise VocabError(f"draft_vocab_size {size} is more rows than the target has ({vocab_size})")
    required = sorted(set(int(i) for i in required))
    if len(required) > size:
        raise VocabError(f"draft_vocab_size {size} cannot hold the {len(required)} tokens the chat template and "
                         f"the stop tokens need (ids {required[:12]}{' ...' if len(required) > 12 else ''}); "
                         f"ask for at least {len(required)}")
    score = counts.double().clone()
    score[required] = float("inf")
    order = torch.argsort(-score, stable=True)  # stable: equal counts keep ascending ids
    return order[:size].sort().values


def coverage(counts: torch.Tensor, target_ids: torch.Tensor) -> dict:
    """How much of the training data's trained target tokens the vocabulary covers (the train report's
    ``draft_vocab``)."""
    total = int(counts.sum())
    inside = int(counts[target_ids].sum())
    return {"draft_vocab_size": int(target_ids.numel()), "target_vocab_size": int(counts.numel()),
            "trained_tokens": total, "trained_tokens_covered": inside,
            "coverage": inside / total if total else 0.0,
            "distinct_trained_tokens": int((counts > 0).sum()),
            "distinct_covered": int((counts[target_ids] > 0).sum())}
