"""The ids that end a generated turn."""

from __future__ import annotations

from types import SimpleNamespace

from dfp_shared.models.stop_tokens import stop_token_ids


def _tokenizer(eos, vocab):
    return SimpleNamespace(eos_token_id=eos, get_vocab=lambda: vocab)


def test_stop_token_ids():
    vocab = {"<|im_end|>": 7, "<|endoftext|>": 3, "a": 1}
    assert stop_token_ids(_tokenizer(3, vocab)) == [3, 7]
    assert stop_token_ids(_tokenizer(None, {"a": 1})) == []
    assert stop_token_ids(_tokenizer(9, vocab), [11, 12], None, 5) == [3, 5, 7, 9, 11, 12]
