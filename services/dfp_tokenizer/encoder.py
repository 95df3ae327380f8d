"""Samples to token ids and loss masks: template spans in characters, one batch tokenization.

:class:`SampleEncoder` renders each conversation (see :mod:`.template_spans`), keeps the
character spans to train, tokenizes a whole batch of rendered texts with one ``encode_batch``
call of the Rust tokenizer (no special tokens added: the template prints them), and turns the
character spans into a token mask with ``char_to_token`` at the span ends. A token is trained if
any character of it is in a trained span.

Records are rendered in batches in a render process (:mod:`.render_process`), each under the
operator's budget: over it (its watchdog's time or memory, its address space limit, or one call that
does not return and gets the process killed), the record is a bad line (``template_budget``). A batch the tokenizer refuses as a whole is
tokenized again one record at a time, so that only the record it refuses is lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace

import numpy as np
from dfp_shared.chat_template.budget import run_within
from dfp_shared.models.tokenizer_assets import chat_template_fingerprint, tokenizer_fingerprint
from dfp_shared.specs.tokenize import TokenizeSpec

from . import records as R
from . import render_process
from .limits import EncodeLimits, TemplateUnavailable
from .records import Sample, SampleError
from .render_process import RenderConfig, RenderRefused
from .template_spans import TemplateLocator, TurnSpan


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

    def __init__(self, tokenizer, spec: TokenizeSpec, limits: EncodeLimits | None = None):
        self.spec = spec
        self.limits = limits or EncodeLimits()
        self.backend = tokenizer.backend_tokenizer
        template = self.limits.resolve_template(spec.chat_template) or tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()))
        specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        origin = "the job's chat_template" if spec.chat_template else "the tokenizer's chat template"
        self.render_config = RenderConfig(
            dict(template=template or "", special_tokens=dict(tokenizer.special_tokens_map),
                 special_token_texts=specials, thinking=spec.thinking, template_kwargs=spec.template_kwargs,
                 max_chars=self.limits.max_rendered_chars),
            seconds=self.limits.template_timeout_s, memory_bytes=self.limits.template_memory_bytes,
            max_chars=self.limits.max_rendered_chars)
        try:
            render_process.build(self.render_config)
        except RenderRefused as exc:
            if exc.kind == "compile":
                raise TemplateUnavailable(f"{origin} does not compile: {exc.detail}") from None
            if exc.kind == "budget":
                raise TemplateUnavailable(f"{origin} is over its render budget on a probe conversation: {exc.detail} "
                                          f"(chat_template budget: {self.limits.template_timeout_s:g} s, "
                                          f"{self.limits.template_memory_bytes // 2**20} MiB)") from None
            raise ValueError(exc.detail) from None
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        self.chat_template_fingerprint = chat_template_fingerprint(SimpleNamespace(chat_template=template))

    @cached_property
    def locator(self) -> TemplateLocator:
        """The template's locator in this process, for inspection (records render in a render process)."""
        return run_within(lambda: TemplateLocator(**self.render_config.locator_args),
                          seconds=self.limits.template_timeout_s, memory_bytes=self.limits.template_memory_bytes)

    def prepare(self, sample: Sample, check=None) -> Prepared:
        """:meth:`prepare_many` of one sample; raises its :class:`SampleError`."""
        res = self.prepare_many([sample], check)[0]
        if isinstance(res, SampleError):
            raise res
        return res

    def prepare_many(self, samples: list[Sample], check=None) -> list[Prepared | SampleError]:
        """Render and locate each sample within the budget, in a render process that is killed when one
        overruns (:mod:`.render_process`): a :class:`Prepared` or a :class:`SampleError` (template
        errors, over budget, nothing to train) per sample; what ``check`` raises, if it stopped them,
        propagates."""
        if not samples:
            return []
        answers = render_process.render(self.render_config, [(s.messages, s.tools) for s in samples], check)
        out: list[Prepared | SampleError] = []
        for sample, answer in zip(samples, answers):
            if answer[0] == "bad":
                out.append(SampleError(answer[1], answer[2], sample.id))
                continue
            try:
                out.append(self._spans(sample, answer[1], [TurnSpan(*t) for t in answer[2]]))
            except SampleError as exc:
                out.append(exc)
        return out

    def _spans(self, sample: Sample, text: str, turns: list[TurnSpan]) -> Prepared:
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
            raise SampleError(R.NO_TRAINABLE_TOKENS, "no assistant text to train after applying the chat template",
                              sample.id)
        return Prepared(sample.id, text, spans)

    def encode(self, batch: list[Prepared]) -> list[Encoded | SampleError]:
        """Tokenize a batch at once; over-long samples are dropped or cut per the spec."""
        if not batch:
            return []
        try:
            encodings = self.backend.encode_batch([p.text for p in batch], add_special_tokens=False)
        except Exception:  # noqa: BLE001 - one record refused: find it, keep the others
            encodings = [self._encode_one(p) for p in batch]
        out: list[Encoded | SampleError] = []
        limit = self.spec.max_length
        for p, enc in zip(batch, encodings):
            if isinstance(enc, SampleError):
                out.append(enc)
                continue
            ids = np.asarray(enc.ids, dtype=np.int32)
            n = len(ids)
            if limit and n > limit and self.spec.truncation == "drop":
                out.append(SampleError(R.TOO_LONG, f"{n} tokens > max_length {limit}", p.sample_id))
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
                out.append(SampleError(R.NO_TRAINABLE_TOKENS, "no trained token left" + (
                    f" in the first {limit} tokens" if truncated else ""), p.sample_id))
                continue
            out.append(Encoded(p.sample_id, ids, mask, truncated))
        return out


    def _encode_one(self, p: Prepared):
        try:
            return self.backend.encode(p.text, add_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - this record's failure only
            try:
                p.text.encode("utf-8")
            except UnicodeEncodeError as bad:
                code = ord(p.text[bad.start])
                return SampleError(R.INVALID_UNICODE, f"the text holds a lone surrogate U+{code:04X} at character "
                                                    f"{bad.start}: not valid Unicode", p.sample_id)
            return SampleError(R.TOKENIZER_ERROR, f"the tokenizer failed: {type(exc).__name__}", p.sample_id)


def _token_at(enc, pos: int, stop: int, step: int) -> int | None:
    """Index of the token holding character ``pos``, walking towards ``stop`` past unmapped characters."""
    while pos != stop:
        t = enc.char_to_token(pos)
        if t is not None:
            return t
        pos += step
    return None
