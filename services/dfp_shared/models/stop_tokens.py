"""The token ids that end a generated assistant turn."""

from __future__ import annotations

CHAT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def stop_token_ids(tokenizer, *eos_token_ids: int | list[int] | None) -> list[int]:
    """Sorted ids of the tokenizer's end-of-sequence token, the chat stop tokens in its vocabulary, and
    ``eos_token_ids`` (each an id, a list of ids or None, e.g. a generation config's ``eos_token_id``)."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in CHAT_STOP_TOKENS if t in vocab}
    for eos in (tokenizer.eos_token_id, *eos_token_ids):
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    return sorted(ids)
