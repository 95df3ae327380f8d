"""Samples to token ids and loss masks: template spans in characters, one batch tokenization.

:class:`SampleEncoder` renders each conversation (see :mod:`.template_spans`), keeps the
character spans to train, tokenizes a whole batch of rendered texts with one ``encode_batch``
call of the Rust tokenizer (no special tokens added: the template prints them), and turns the
character spans into a token mask with ``char_to_token`` at the span ends. A token is trained if
any character of it is in a trained span.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from dfp_shared.specs.tokenize import TokenizeSpec
from dfp_shared.tokenizer_assets import chat_template_fingerprint, tokenizer_fingerprint

from .records import NO_TRAINABLE_TOKENS, TOO_LONG, Sample, SampleError
from .template_spans import TemplateLocator


@dataclass
class Prepared:
    """A sample rendered and located, waiting for its batch tokenization."""

    sample_id: str
    text: str
    spans: list[tuple[int, int]]
    """Character spans to train, sorted and disjoint."""


@dataclass
class Encoded:
    sample_id: str
    ids: np.ndarray  # (T,) int32
    mask: np.ndarray  # (T,) uint8
    truncated: bool = False


class SampleEncoder:
    """One tokenizer + one chat template + the job's masking options."""

    def __init__(self, tokenizer, spec: TokenizeSpec):
        self.spec = spec
        self.backend = tokenizer.backend_tokenizer
        template = spec.chat_template or tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()))
        specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        self.locator = TemplateLocator(template or "", dict(tokenizer.special_tokens_map), specials,
                                       thinking=spec.thinking, template_kwargs=spec.template_kwargs)
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        self.chat_template_fingerprint = chat_template_fingerprint(SimpleNamespace(chat_template=template))

    def prepare(self, sample: Sample) -> Prepared:
        """Render and locate; raises :class:`SampleError` (template errors, nothing to train)."""
        text, turns = self.locator.locate(sample.messages)
        if self.spec.train_turns == "last":
            last = max((i for i, m in enumerate(sample.messages) if m["role"] == "assistant"), default=None)
            turns = [t for t in turns if t.message_index == last]
        spans = []
        for t in turns:
            start = t.gen_start
            if not self.spec.train_reasoning:
                start = t.content[0] if t.content else (t.reasoning[1] if t.reasoning else t.gen_start)
            if t.gen_end > start:
                spans.append((start, t.gen_end))
        if not spans:
            raise SampleError(NO_TRAINABLE_TOKENS, "no assistant text to train after applying the chat template",
                              sample.id)
        return Prepared(sample.id, text, spans)

    def encode(self, batch: list[Prepared]) -> list[Encoded | SampleError]:
        """Tokenize a batch at once; over-long samples are dropped or cut per the spec."""
        if not batch:
            return []
        encodings = self.backend.encode_batch([p.text for p in batch], add_special_tokens=False)
        out: list[Encoded | SampleError] = []
        limit = self.spec.max_length
        for p, enc in zip(batch, encodings):
            ids = np.asarray(enc.ids, dtype=np.int32)
            n = len(ids)
            if limit and n > limit and self.spec.truncation == "drop":
                out.append(SampleError(TOO_LONG, f"{n} tokens > max_length {limit}", p.sample_id))
                continue
            mask = np.zeros(n, dtype=np.uint8)
            for a, b in p.spans:
                t0, t1 = _token_at(enc, a, b, +1), _token_at(enc, b - 1, a - 1, -1)
                if t0 is not None and t1 is not None and t1 >= t0:
                    mask[t0:t1 + 1] = 1
            truncated = False
            if limit and n > limit:
                ids, mask, truncated = ids[:limit], mask[:limit], True
            if not mask.any():
                out.append(SampleError(NO_TRAINABLE_TOKENS, "no trained token left" + (
                    f" in the first {limit} tokens" if truncated else ""), p.sample_id))
                continue
            out.append(Encoded(p.sample_id, ids, mask, truncated))
        return out


def _token_at(enc, pos: int, stop: int, step: int) -> int | None:
    """Index of the token holding character ``pos``, walking towards ``stop`` past unmapped characters."""
    while pos != stop:
        t = enc.char_to_token(pos)
        if t is not None:
            return t
        pos += step
    return None
