"""Exact assistant spans for any chat template, found in characters before the one tokenization.

For a conversation the template is rendered twice, never tokenized:

1. the real conversation, ``text`` (what gets tokenized);
2. a *skeleton*: the same conversation with each message's text replaced by a unique marker
   (private-use characters). The markers split the skeleton into the template's own literal
   pieces ``L0 m1 L1 m2 ... Ln``.

``text`` is then aligned to ``L0 X1 L1 X2 ... Ln``: each ``Xi`` must be the message's text as the
template printed it (verbatim, or with the whitespace stripping templates do), followed by the
next literal. That gives the character span of every message, whatever the template does around
them (Qwen3 dropping earlier turns' reasoning simply leaves those markers out). If a template's
control flow depends on user text, the skeleton differs from ``text`` and the alignment fails;
the locator then retries with only the assistant fields replaced, and only then gives up on the
sample (``template_alignment``) rather than guess. The names of an assistant turn's tool calls are
located the same way (a marker in place of each name), so a turn that only calls tools, with no
text, still has a span; a template that does not print a name once per call is aligned without
them.

An assistant turn's generated region starts after the template's generation prompt (the text
``add_generation_prompt=True`` appends, e.g. ``<|im_start|>assistant\\n``; where a turn does not
print it whole, e.g. Qwen3's non-thinking prompt with its empty ``<think>`` block before a turn
that has none, the prompt the template appends with thinking on) and ends after the
end-of-turn token that follows its content (the first special token the template prints after an
assistant message, e.g. ``<|im_end|>``), so it includes a ``<think>`` block and tool calls. Both are
searched among the template's own prints of those texts only: the same text inside a content, a
reasoning, a tool call's arguments or a tool definition (where the tokenizer reads it as the same special
token) is told apart by a second render with such occurrences replaced by markers, and is never taken
for a turn's bound.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass

from dfp_shared.chat_template.render import compile_template
from dfp_shared.records.thinking import THINK_CLOSE, THINK_OPEN, split_inline_reasoning

from .limits import EncodeLimits
from .records import TEMPLATE_ALIGNMENT, TEMPLATE_ERROR, SampleError, short_detail

MARKER_CHARS = [("\ue000", "\ue001"), ("\uf8f0", "\uf8f1"), ("\U000f0000", "\U000f0001")]
PROBE = "\ue002probe\ue003"
SKELETON_CACHE = 4096


@dataclass
class TurnSpan:
    """Character spans of one assistant turn in the rendered text."""

    message_index: int
    gen_start: int
    gen_end: int
    reasoning: tuple[int, int] | None
    content: tuple[int, int] | None


class Message(dict):
    """A message dict whose keys also read as attributes (``message.content``), the way templates
    read them: the sandbox then finds them without an AttributeError per lookup."""

    __slots__ = ()

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _compile(template: str, max_chars: int | None = None):
    """The template in the sized sandbox (:func:`dfp_shared.chat_template.compile_template`), refusing any
    single operation making more than ``max_chars`` characters, the rendered text included."""
    return compile_template(template, max_chars or EncodeLimits().max_rendered_chars)


def _candidates(value: str) -> list[str]:
    out = []
    for c in (value, value.strip("\n"), value.lstrip("\n"), value.rstrip("\n"), value.strip(), value.lstrip(),
              value.rstrip()):
        if c not in out:
            out.append(c)
    return out


class TemplateLocator:
    """Renders conversations with one chat template and finds each assistant turn's spans."""

    def __init__(self, template: str, special_tokens: dict[str, str], special_token_texts: list[str], *,
                 thinking: bool = True, template_kwargs: dict | None = None, max_chars: int | None = None):
        if not template:
            raise ValueError("the tokenizer has no chat template (set the job's chat_template)")
        self.compiled = _compile(template, max_chars)
        # tools and documents are the template's arguments: None unless the job or the record gives them
        self.variables = {"tools": None, "documents": None, **special_tokens, **(template_kwargs or {}),
                          "enable_thinking": thinking}
        self.thinking = thinking
        self.specials = sorted(set(special_token_texts), key=len, reverse=True)
        self._skeletons: dict[tuple, tuple[list[str], list]] = {}
        # the generation prompt first, then the other thinking mode's (a turn may print only that one)
        self.generation_prompts = list(dict.fromkeys(g for g in (self._probe_generation_prompt(thinking),
                                                                 self._probe_generation_prompt(not thinking)) if g))
        self.end_of_turn = self._probe_end_of_turn()
        self.splits_inline_reasoning = self._probe_inline_reasoning()

    # rendering

    def template_messages(self, messages: list[dict], values: dict | None = None) -> list[dict]:
        """Messages as the template sees them (``values`` overrides (index, field) texts)."""
        out = []
        for i, m in enumerate(self.own_messages(messages)):
            msg = {k: v for k, v in m.items() if k != "reasoning" and v is not None}
            msg["content"] = values.get((i, "content"), m["content"]) if values else m["content"]
            if values and m.get("tool_calls") and any((i, "tool", j) in values for j in range(len(m["tool_calls"]))):
                msg["tool_calls"] = [_with_name(tc, values.get((i, "tool", j))) for j, tc in enumerate(m["tool_calls"])]
            # without thinking, an explicit empty reasoning keeps templates from parsing <think> out of content
            reasoning = m.get("reasoning") if self.thinking else ("" if m["role"] == "assistant" else None)
            if reasoning is not None:
                reasoning = values.get((i, "reasoning"), reasoning) if values else reasoning
                msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
            out.append(Message(msg))
        return out

    def own_messages(self, messages: list[dict]) -> list[dict]:
        """``messages`` with inline ``<think>`` reasoning split off the assistants' content where this
        template itself reads it as reasoning (see :meth:`_probe_inline_reasoning`); as given elsewhere."""
        if not self.splits_inline_reasoning:
            return messages
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("reasoning") is None and THINK_CLOSE in m["content"]:
                reasoning, content = split_inline_reasoning(m["content"])
                m = {**m, "content": content, "reasoning": reasoning}
            out.append(m)
        return out

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **overrides) -> str:
        return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **{**self.variables, **overrides})

    def _probe_inline_reasoning(self) -> bool:
        """Whether the template renders reasoning written inline in an assistant's content exactly as the
        same reasoning given apart (``reasoning_content``), with and without the opening ``<think>``."""
        user = {"role": "user", "content": PROBE}
        for inline in (f"{THINK_OPEN}\n{PROBE}r\n{THINK_CLOSE}\n\n{PROBE}c", f"{PROBE}r{THINK_CLOSE}{PROBE}c"):
            try:
                as_text = self.render([user, Message(role="assistant", content=inline)], enable_thinking=True)
                apart = self.render([user, Message(role="assistant", content=PROBE + "c", reasoning_content=PROBE + "r",
                                                   thinking=PROBE + "r")], enable_thinking=True)
            except MemoryError:  # one allocation over the memory limit: over budget, not a template error
                raise
            except Exception:  # noqa: BLE001
                return False
            if as_text != apart:
                return False
        return True

    def _probe_generation_prompt(self, thinking: bool) -> str:
        for msgs in ([{"role": "user", "content": PROBE}],
                     [{"role": "system", "content": PROBE}, {"role": "user", "content": PROBE}]):
            try:
                without = self.render(msgs, enable_thinking=thinking)
                with_prompt = self.render(msgs, add_generation_prompt=True, enable_thinking=thinking)
            except MemoryError:
                raise
            except Exception:  # noqa: BLE001 - some templates insist on a system turn
                continue
            if with_prompt.startswith(without):
                return with_prompt[len(without):]
        return ""

    def _probe_end_of_turn(self) -> str | None:
        msgs = [{"role": "user", "content": PROBE}, {"role": "assistant", "content": PROBE + "a"}]
        try:
            text = self.render(msgs)
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001
            return None
        after = text[text.find(PROBE + "a") + len(PROBE) + 1:]
        best = None
        for tok in self.specials:
            k = after.find(tok)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, tok)
        return best[1] if best else None

    # locating

    def locate(self, messages: list[dict], tools: list | None = None) -> tuple[str, list[TurnSpan]]:
        """Render ``messages`` once for real and return (text, assistant turn spans in message order).
        ``tools``: the record's tool definitions (None: the job's ``template_kwargs.tools``, if any)."""
        overrides = {"tools": tools} if tools is not None else {}
        messages = self.own_messages(messages)
        try:
            text = self.render(self.template_messages(messages), **overrides)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - template raise_exception() and friends
            raise SampleError(TEMPLATE_ERROR, f"chat template failed: {short_detail(str(exc))}") from None
        tool_names = (True, False) if any(m.get("tool_calls") for m in messages) else (False,)
        for names in tool_names:
            for only_assistant, strict in ((False, True), (True, True), (True, False)):
                spans = self._field_spans(messages, text, only_assistant, strict, names, overrides)
                if spans is not None:
                    return text, self._turns(messages, text, spans, overrides)
        raise SampleError(TEMPLATE_ALIGNMENT, "could not locate the assistant turns in the rendered chat template")

    def _markers(self, messages: list[dict]) -> tuple[str, str]:
        blob = "".join(m["content"] + (m.get("reasoning") or "")
                       + (json.dumps(m["tool_calls"], ensure_ascii=False, default=str) if m.get("tool_calls") else "")
                       for m in messages)
        for open_, close in MARKER_CHARS:
            if open_ not in blob and close not in blob:
                return open_, close
        raise SampleError(TEMPLATE_ALIGNMENT, "the sample uses every private-use marker character")

    def _field_spans(self, messages, text, only_assistant: bool, strict: bool, tool_names: bool,
                     overrides: dict) -> dict | None:
        open_, close = self._markers(messages)
        fields = []
        for i, m in enumerate(messages):
            if only_assistant and m["role"] != "assistant":
                continue
            if m["content"]:
                fields.append((i, "content"))
            if self.thinking and m["role"] == "assistant" and m.get("reasoning"):
                fields.append((i, "reasoning"))
            if tool_names and m["role"] == "assistant":
                fields += [(i, "tool", j) for j, tc in enumerate(m.get("tool_calls") or []) if _tool_name(tc)]
        # with every text replaced, the skeleton depends only on the conversation's structure: cache it
        key = None if only_assistant else (open_, tool_names, tuple(_shape(m) for m in messages),
                                           _canonical(overrides.get("tools")))
        parsed = self._skeletons.get(key) if key else None
        if parsed is None:
            values = {f: f"{open_}{n}{close}" for n, f in enumerate(fields)}
            try:
                skeleton = self.render(self.template_messages(messages, values), **overrides)
            except MemoryError:
                raise
            except Exception:  # noqa: BLE001
                return None
            pieces = re.split(f"{open_}(\\d+){close}", skeleton)
            parsed = pieces[0::2], [fields[int(n)] for n in pieces[1::2]]
            if len(set(parsed[1])) != len(parsed[1]):
                return None  # a template that prints a text twice: no single span
            if key:
                if len(self._skeletons) >= SKELETON_CACHE:
                    self._skeletons.clear()
                self._skeletons[key] = parsed
        return self._align(text, parsed[0], parsed[1], messages, strict)

    @staticmethod
    def _align(text: str, literals: list[str], order: list, messages: list[dict], strict: bool) -> dict | None:
        if not text.startswith(literals[0]):
            return None
        pos = len(literals[0])
        spans = {}
        for n, f in enumerate(order):
            value = _field_value(messages, f)
            lit = literals[n + 1]
            last = n + 1 == len(order)
            end = None
            for c in _candidates(value):
                e = pos + len(c)
                if text.startswith(c, pos) and (text[e:] == lit if last else text.startswith(lit, e)):
                    end = e
                    break
            if end is None:
                if strict:
                    return None
                if last:
                    end = len(text) - len(lit) if text.endswith(lit) and len(text) - len(lit) >= pos else None
                else:
                    end = text.find(lit, pos) if lit else None
                if end is None or end < 0:
                    return None
            spans[f] = (pos, end)
            pos = end + len(lit)
        return spans if pos == len(text) else None

    def _turns(self, messages: list[dict], text: str, spans: dict, overrides: dict) -> list[TurnSpan]:
        bounds = sorted(spans.values())
        own_at = self._template_own(messages, text, overrides)
        eot = self.end_of_turn
        turns = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            r, c = spans.get((i, "reasoning")), spans.get((i, "content"))
            tools = [s for f, s in spans.items() if f[0] == i and f[1] == "tool"]
            own = [s for s in (r, c, *tools) if s is not None]
            if not own:
                if i != len(messages) - 1:
                    continue  # nothing of this turn was printed (or it is empty): not trainable
                # an empty last turn: what the template prints after the conversation before it with the
                # generation prompt, if the render starts with that
                prompt = self.render(self.template_messages(messages[:i]), add_generation_prompt=True, **overrides)
                start = len(prompt) if text.startswith(prompt) else len(text)
                own = [(start, start)]
            first, last = min(a for a, _ in own), max(b for _, b in own)
            prev_end = max((b for a, b in bounds if b <= first and (a, b) not in own), default=0)
            if eot:  # after the previous turn's end, where no text of its own was located
                k = _last_in(own_at[eot], prev_end, first - len(eot))
                prev_end = prev_end if k is None else k + len(eot)
            gen_start = first
            for g in self.generation_prompts if c or r or tools else ():
                k = _last_in(own_at[g], prev_end, first - len(g))
                if k is not None:
                    gen_start = k + len(g)
                    break
            nxt = min((a for a, b in bounds if a >= last and (a, b) not in own), default=len(text))
            gen_end = last
            if eot:  # the template's own end-of-turn token (not one in the arguments of the turn's tool calls)
                k = _first_in(own_at[eot], last, nxt - len(eot))
                if k is not None:
                    gen_end = k + len(eot)
            turns.append(TurnSpan(i, gen_start, gen_end, r, c))
        return turns

    def _template_own(self, messages: list[dict], text: str, overrides: dict) -> dict[str, list[int]]:
        """Where in ``text`` the template itself prints its end-of-turn token and its generation prompts
        (the texts the turn boundaries are searched by), by text, apart from the same texts inside the
        conversation's own strings (contents, reasoning, tool calls, tool definitions), which a turn's
        bounds must not stop at.

        Where the conversation holds none of them every occurrence is the template's. Otherwise the
        conversation is rendered once more with each such occurrence replaced by a marker: the markers
        mark the conversation's occurrences. Where the template does not print those strings verbatim (the
        second render, markers put back, is not ``text``) and they appear in ``text`` more often than the
        template prints them itself, the two cannot be told apart: the sample is refused
        (``template_alignment``, naming the field) rather than trained on a guessed span."""
        own_at = {s: _occurrences(text, s) for s in (self.end_of_turn, *self.generation_prompts) if s}
        # (a text of whitespace only, which no marker can stand for, is taken as the template's wherever it is)
        sentinels = sorted((s for s in own_at if s.strip()), key=len, reverse=True)
        tools = overrides.get("tools", self.variables.get("tools"))
        found = [w for w, v in _strings_of(messages, tools) if any(s in v for s in sentinels)]
        if not found:
            return own_at
        open_, close = self._markers(messages)
        # a marker stands for a text less its surrounding whitespace, which stays: templates that strip a
        # content strip the same characters with the markers in
        mark = {s: s[:len(s) - len(s.lstrip())] + f"{open_}s{n}{close}" + s[len(s.rstrip()):]
                for n, s in enumerate(sentinels)}
        pattern = re.compile("|".join(re.escape(s) for s in sentinels))

        def swap(value):
            if isinstance(value, str):
                return pattern.sub(lambda x: mark[x.group(0)], value)
            if isinstance(value, dict):
                return {swap(k): swap(v) if k != "role" else v for k, v in value.items()}
            if isinstance(value, list):
                return [swap(v) for v in value]
            return value

        try:
            marked = self.render(self.template_messages(swap(messages)),
                                 **({**overrides, "tools": swap(tools)} if tools is not None else overrides))
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001
            marked = None
        if marked is not None:
            pieces = re.split(f"{open_}s(\\d+){close}", marked)
            pos, restored, mine = 0, [], {s: [] for s in sentinels}
            for n, piece in enumerate(pieces):
                if n % 2:
                    piece = sentinels[int(piece)].strip()
                else:
                    for s in sentinels:
                        mine[s] += [pos + k for k in _occurrences(piece, s)]
                restored.append(piece)
                pos += len(piece)
            if "".join(restored) == text:
                return {**own_at, **mine}
            if all(len(mine[s]) == len(own_at[s]) for s in sentinels):
                return own_at  # printed otherwise (escaped, cut): every occurrence left in the text is the template's
        raise SampleError(TEMPLATE_ALIGNMENT, f"{found[0]} holds the chat template's "
                                              "end-of-turn or generation prompt text where the template does not "
                                              "print it verbatim: the turn's end cannot be told apart from it")


def _occurrences(text: str, sub: str) -> list[int]:
    out, k = [], text.find(sub)
    while k >= 0:
        out.append(k)
        k = text.find(sub, k + 1)
    return out


def _first_in(positions: list[int], lo: int, hi: int) -> int | None:
    """The first of the sorted ``positions`` in [lo, hi]."""
    k = bisect.bisect_left(positions, lo)
    return positions[k] if k < len(positions) and positions[k] <= hi else None


def _last_in(positions: list[int], lo: int, hi: int) -> int | None:
    """The last of the sorted ``positions`` in [lo, hi]."""
    k = bisect.bisect_right(positions, hi) - 1
    return positions[k] if k >= 0 and positions[k] >= lo else None


def _strings_of(messages: list[dict], tools) -> list[tuple[str, str]]:
    """Every string of the conversation (its keys included), with where it is (``message 2 tool_calls``)."""
    out = []

    def walk(where, value):
        if isinstance(value, str):
            out.append((where, value))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(where, k)
                walk(where, v)
        elif isinstance(value, list):
            for v in value:
                walk(where, v)

    for i, m in enumerate(messages):
        for k, v in m.items():
            if k != "role":
                walk(f"message {i} {k}", v)
    walk("the tool definitions", tools)
    return out


def _canonical(value) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, default=str)


def _shape(m: dict) -> tuple:
    """What of a message the skeleton depends on once its texts are markers."""
    extra = tuple((k, json.dumps(v, sort_keys=True, default=str)) for k, v in sorted(m.items())
                  if k not in ("role", "content", "reasoning"))
    r = m.get("reasoning")
    return m["role"], bool(m["content"]), None if r is None else bool(r), extra


def _tool_name(call) -> str | None:
    """The function name of a tool call (``{"function": {"name": ...}}`` or ``{"name": ...}``), if any."""
    if not isinstance(call, dict):
        return None
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    return name if isinstance(name, str) and name else None


def _with_name(call, name: str | None):
    """A copy of a tool call with its function name replaced (the call itself when ``name`` is None)."""
    if name is None:
        return call
    if isinstance(call.get("function"), dict):
        return {**call, "function": {**call["function"], "name": name}}
    return {**call, "name": name}


def _field_value(messages: list[dict], field: tuple) -> str:
    if field[1] == "tool":
        return _tool_name(messages[field[0]]["tool_calls"][field[2]])
    return messages[field[0]][field[1]]
