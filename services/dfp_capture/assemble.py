"""What one captured exchange is: the request's prompt and sampling parameters, and the reply reassembled
from a JSON body or from its server-sent events, choice by choice.

Nothing here touches the network or storage: the proxy keeps the reply's bytes as they pass through, the
writer reads them into the exchange (:func:`settle`) and :func:`completion_records` turns the exchange into
completion records (``dfp_shared.records.completions``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dfp_shared.records.completions import completion_record

CHAT, COMPLETIONS = "chat", "completions"
# the request fields kept as the record's sampling parameters (scalars, bounded strings)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "n", "seed",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop")
TEMPLATE_KWARGS = "chat_template_kwargs"
MAX_STOP = 16
MAX_SHORT = 256
MESSAGE_FIELDS = ("role", "content", "name", "reasoning_content", "tool_call_id")
MAX_DEPTH = 32  # how deep a message's content parts may nest to be kept


def encodable(value: str) -> str:
    """A string as UTF-8 can encode it: lone surrogates (valid JSON escapes, not text) become U+FFFD."""
    if value.isascii():
        return value
    try:
        value.encode()
    except UnicodeEncodeError:
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return value


def clean(value, depth: int = 0):
    """A JSON value with every string, keys included, made encodable; None when it nests too deep."""
    if isinstance(value, str):
        return encodable(value)
    if depth >= MAX_DEPTH:
        return None
    if isinstance(value, list):
        return [clean(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {encodable(k): clean(v, depth + 1) for k, v in value.items()}
    return value


class Unusable(ValueError):
    """A request or reply that is forwarded but not captured; ``reason`` is the dropped counter's label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


def _short(value):
    """A sampling value kept as is when it is a number, a bool or a short string; else None."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return value
    if isinstance(value, str) and len(value) <= MAX_SHORT:
        return encodable(value)
    return None


def sampling_params(body: dict) -> dict:
    params = {}
    for name in SAMPLING:
        value = body.get(name)
        if name == "stop" and isinstance(value, list):
            kept = [encodable(s) for s in value[:MAX_STOP] if isinstance(s, str) and len(s) <= MAX_SHORT]
            value = kept or None
        else:
            value = _short(value)
        if value is not None:
            params[name] = value
    kwargs = body.get(TEMPLATE_KWARGS)
    if isinstance(kwargs, dict):
        kept = {encodable(str(k)[:MAX_SHORT]): _short(v) for k, v in list(kwargs.items())[:MAX_STOP]
                if _short(v) is not None}
        if kept:
            params[TEMPLATE_KWARGS] = kept
    return params


# Request fields that leave the tokens a greedy decoder picks as they are, for the prompt the record keeps;
# every other field does unless it holds its neutral value (NEUTRAL), and an unknown field is taken to.
ANSWER_NEUTRAL = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
    "n", "user", "logprobs", "top_logprobs", "prompt_logprobs", "skip_special_tokens",
    "spaces_between_special_tokens", "request_id", "priority", "metadata", "store", "service_tier",
    "return_tokens_as_token_ids", "parallel_tool_calls"})
NEUTRAL = {  # fields that change the answer unless they hold one of these values (None: the field unset)
    "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "min_tokens": (0,), "ignore_eos": (False,), "bad_words": ([],), "allowed_token_ids": ([],),
    "logits_processors": ([],), "response_format": ({"type": "text"},), "tools": ([],),
    "tool_choice": ("none", "auto"), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "echo": (False,), "best_of": (1,), "use_beam_search": (False,), "suffix": ("",),
    TEMPLATE_KWARGS: ({},)}  # the engines apply it over the template's own arguments (tools, documents, ...)
MAX_REASONS = 8


def not_greedy_reasons(req: dict) -> list[str]:
    """Why the answer to ``req`` is not the target's own greedy answer to its messages: ``sampled`` (neither
    temperature 0 nor top-k 1; an unset temperature is the engine's default, sampled), then each field that
    changes the tokens chosen (a logits processor, guided decoding, a response format, a template of the
    request's own, a continuation, tools) by name; empty when it is."""
    reasons = [] if req.get("temperature") == 0 or req.get("top_k") == 1 else ["sampled"]
    for name, value in req.items():
        if name in ANSWER_NEUTRAL or value is None or value in NEUTRAL.get(name, ()):
            continue
        reasons.append(encodable(str(name)[:64]))
        if len(reasons) >= MAX_REASONS:
            break
    return reasons


def _message(raw) -> dict:
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise Unusable("unreadable_request", "a message without a role")
    return {k: clean(raw[k]) for k in MESSAGE_FIELDS if k in raw and isinstance(raw[k], (str, list))}


def _drops_fields(raw: dict) -> bool:
    """A message the record keeps less than all of (tool calls, say): its answer followed what the record lacks."""
    return any(k not in MESSAGE_FIELDS and v is not None for k, v in raw.items()) or any(
        k in raw and not isinstance(raw[k], (str, list)) and raw[k] is not None for k in MESSAGE_FIELDS)


@dataclass
class Exchange:
    """One admitted request and its reply as it is read; ``choices`` maps a choice's index to its parts."""

    kind: str
    prompt: list[dict]
    model: str | None
    params: dict
    stream: bool
    max_choices: int
    max_bytes: int
    size: int = 0
    not_greedy: list[str] = field(default_factory=list)  # why the answer is not the target's own greedy one
    choices: dict[int, dict] = field(default_factory=dict)

    def add(self, index, content, reasoning, finish) -> None:
        if not isinstance(index, int) or index < 0:
            raise Unusable("malformed_reply", "a choice without an index")
        if index >= self.max_choices:
            return
        choice = self.choices.setdefault(index, {"content": [], "reasoning": [], "finish": None})
        for key, part in (("content", content), ("reasoning", reasoning)):
            if part is None:
                continue
            if not isinstance(part, str):
                raise Unusable("malformed_reply", f"{key} is not text")
            self.size += len(part)
            if self.size > self.max_bytes:
                raise Unusable("too_large")
            choice[key].append(encodable(part))
        if finish is not None:
            choice["finish"] = encodable(str(finish)[:MAX_SHORT])


def admit(kind: str, body: bytes, max_messages: int, max_choices: int, max_bytes: int) -> Exchange:
    """The exchange a request body opens; raises :class:`Unusable` for one that cannot be captured."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        raise Unusable("unreadable_request", "not JSON, or nested too deep") from None
    if not isinstance(req, dict):
        raise Unusable("unreadable_request", "not a JSON object")
    if kind == CHAT:
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Unusable("unreadable_request", "no messages")
        if len(messages) > max_messages:
            raise Unusable("too_large", f"{len(messages)} messages")
        prompt = [_message(m) for m in messages]
        dropped = ["message_fields"] if any(_drops_fields(m) for m in messages) else []
    else:
        text = req.get("prompt")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if not isinstance(text, str):
            raise Unusable("unsupported_prompt", "a prompt that is not one string")
        prompt = [{"role": "user", "content": encodable(text)}]
        dropped = []
    model = req.get("model")
    return Exchange(kind, prompt, encodable(model) if isinstance(model, str) else None, sampling_params(req),
                    bool(req.get("stream")), max_choices, max_bytes, size=len(body),
                    not_greedy=(not_greedy_reasons(req) + dropped)[:MAX_REASONS])


def _choice_parts(exchange: Exchange, choice: dict, delta_key: str):
    if not isinstance(choice, dict):
        raise Unusable("malformed_reply", "a choice that is not an object")
    if exchange.kind == CHAT:
        part = choice.get(delta_key) or {}
        if not isinstance(part, dict):
            raise Unusable("malformed_reply", f"{delta_key} is not an object")
        reasoning = part.get("reasoning_content", part.get("reasoning"))
        return part.get("content"), reasoning
    return choice.get("text"), None


def read_reply(exchange: Exchange, payload) -> None:
    """Add one reply object (a whole JSON body, or one event's data) to the exchange."""
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        raise Unusable("malformed_reply", "no choices")
    if payload.get("model") and not exchange.model and isinstance(payload["model"], str):
        exchange.model = encodable(payload["model"][:MAX_SHORT])
    delta_key = "delta" if exchange.stream else "message"
    for choice in payload["choices"]:
        content, reasoning = _choice_parts(exchange, choice, delta_key)
        exchange.add(choice.get("index", 0), content, reasoning, choice.get("finish_reason"))


_DECODER = json.JSONDecoder()


def _json(data: bytes):
    """One event's data as JSON (what ``json.loads`` reads, less its per-call wrapping)."""
    try:
        decoded = data.decode().strip()
        payload, end = _DECODER.scan_once(decoded, 0)
    except (ValueError, StopIteration, RecursionError):
        raise Unusable("malformed_reply", "an event whose data is not JSON") from None
    if end != len(decoded):
        raise Unusable("malformed_reply", "an event whose data is not JSON")
    return payload


class EventReader:
    """Server-sent events read as their bytes arrive: each complete event's ``data:`` lines joined, JSON read
    into the exchange; ``[DONE]`` ends the stream. Anything else is a malformed reply."""

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self.buffer = b""
        self.done = False

    def feed(self, chunk: bytes) -> None:
        events = (self.buffer + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
        self.buffer = events.pop()
        if len(self.buffer) > self.exchange.max_bytes:
            raise Unusable("too_large", "an event larger than a record")
        for event in events:
            self._event(event)

    def _event(self, event: bytes) -> None:
        if event.startswith(b"data: ") and b"\n" not in event:  # what the engines send: one data line
            text = event[6:]
        else:
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if not data:
                return  # comments, keep-alives and other fields carry no data
            text = b"\n".join(data)
        if self.done:
            raise Unusable("malformed_reply", "data after [DONE]")
        if text == b"[DONE]" or text.strip() == b"[DONE]":
            self.done = True
            return
        read_reply(self.exchange, _json(text))

    def finish(self) -> None:
        """The upstream's stream ended: it must have ended with ``[DONE]`` and nothing after it."""
        if self.buffer.strip():
            self._event(self.buffer)
            self.buffer = b""
        if not self.done:
            raise Unusable("malformed_reply", "a stream without [DONE]")


def settle(exchange: Exchange, reply: bytes, events: EventReader | None, whole: bool) -> None:
    """Read a reply's kept bytes into its exchange: a stream's events (``whole``: it must have ended with
    ``[DONE]``), else one JSON body. Raises :class:`Unusable` for one that cannot be read."""
    if events is None:
        try:
            payload = json.loads(reply)
        except (ValueError, RecursionError):
            raise Unusable("malformed_reply", "a reply that is not JSON, or nested too deep") from None
        read_reply(exchange, payload)
        return
    events.feed(reply)
    if whole:
        events.finish()


def completion_records(exchange: Exchange, record_id: str, meta: dict) -> list[dict]:
    """The exchange as completion records, one a choice; ``meta`` (capture fields) is added to each."""
    base = {"model": exchange.model, "sampling": exchange.params, "endpoint": exchange.kind,
            "greedy": not exchange.not_greedy, **meta}
    if exchange.not_greedy:
        base["not_greedy"] = exchange.not_greedy
    records = []
    for index in sorted(exchange.choices):
        choice = exchange.choices[index]
        reasoning = "".join(choice["reasoning"]) if choice["reasoning"] else None
        rid = record_id if len(exchange.choices) == 1 else f"{record_id}-{index}"
        records.append(completion_record(rid, exchange.prompt, "".join(choice["content"]), reasoning,
                                         {**base, "finish_reason": choice["finish"], "choice": index}))
    return records
