"""Input records (one JSON object per line, or per element of a JSON array, or a Parquet/Arrow row),
normalised into chat messages.

Accepted shapes (DESIGN.md's completion record plus the common public ones):

* ``{"id", "messages": [{"role", "content", "reasoning_content"?}], "meta"}`` (the completion record);
* ``{"conversations": [{"role", "content"}]}`` or ``{"conversations": [{"from", "value"}]}`` (ShareGPT:
  ``human``/``gpt``/``system``/``function_call``/``observation``);
* content given as a list of ``{"type": "text", "text": ...}`` parts;
* reasoning given as ``reasoning_content``, ``reasoning`` or ``thinking``; reasoning written inline
  as ``<think>...</think>`` in an assistant's content stays in the content here: the chat template
  locator splits it off only for a template that itself reads it as reasoning;
* tool definitions as the record's ``tools`` list (passed to the template as ``tools``).

A line that cannot be used raises :class:`SampleError` with a reason code; the file loop counts
reasons and writes them, with file and line, to the errors file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dfp_shared.records.completions import REASONING, record_id, record_messages

ROLE_ALIASES = {
    "user": "user", "human": "user", "system": "system", "assistant": "assistant", "gpt": "assistant",
    "model": "assistant", "bot": "assistant", "chatgpt": "assistant", "tool": "tool", "function": "tool",
    "observation": "tool", "ipython": "tool", "function_call": "assistant",
}
REASONING_FIELDS = (REASONING, "reasoning", "thinking")
PASSTHROUGH_FIELDS = ("tool_calls", "name", "tool_call_id")

# reason codes (also the keys of the errors-by-reason counters)
MALFORMED_JSON = "malformed_json"
NOT_AN_OBJECT = "not_an_object"
NO_MESSAGES = "no_messages"
EMPTY_CONVERSATION = "empty_conversation"
BAD_MESSAGE = "bad_message"
UNKNOWN_ROLE = "unknown_role"
NO_ASSISTANT_TURN = "no_assistant_turn"
TOO_LONG = "too_long"
NO_TRAINABLE_TOKENS = "no_trainable_tokens"
TEMPLATE_ERROR = "template_error"
TEMPLATE_ALIGNMENT = "template_alignment"
TEMPLATE_BUDGET = "template_budget"
LINE_TOO_LONG = "line_too_long"
INVALID_UNICODE = "invalid_unicode"
TOKENIZER_ERROR = "tokenizer_error"
BLANK_LINE = "blank_line"
INVALID_UTF8 = "invalid_utf8"
DUPLICATE_ID = "duplicate_id"

EXCERPT_CHARS = 16
DETAIL_CHARS = 160


def excerpt(value) -> str:
    """A short, printable excerpt of a value from the input (bad lines are never quoted at length)."""
    text = value if isinstance(value, str) else type(value).__name__
    short = text[:EXCERPT_CHARS]
    return ascii(short)[:-1] + ("...'" if len(text) > EXCERPT_CHARS else "'")


def short_detail(text: str) -> str:
    """An error message cut to ``DETAIL_CHARS`` (messages may carry input text)."""
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."


class SampleError(ValueError):
    """A sample that cannot be used: ``reason`` is a stable code, the message says why."""

    def __init__(self, reason: str, detail: str, sample_id: str | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.sample_id = sample_id


@dataclass
class Sample:
    id: str
    messages: list[dict]
    """Normalised messages: role, content (str), reasoning (str | None), plus pass-through fields."""
    tools: list | None = None
    """The record's tool definitions (None: none given)."""


def _text(value, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else None
                raise SampleError(BAD_MESSAGE, f"{where}: only text content parts are supported, got "
                                               + (f"a part of type {excerpt(kind)}" if kind is not None
                                                  else f"a {type(part).__name__}"))
        return "".join(parts)
    raise SampleError(BAD_MESSAGE, f"{where}: content must be a string or a list of text parts, got {type(value).__name__}")


def normalise_message(raw, index: int) -> dict:
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise SampleError(BAD_MESSAGE, f"{where}: expected an object, got {type(raw).__name__}")
    role_raw = raw.get("role", raw.get("from"))
    if not isinstance(role_raw, str):
        raise SampleError(BAD_MESSAGE, f"{where}: no 'role' (or 'from') field")
    role = ROLE_ALIASES.get(role_raw.strip().lower())
    if role is None:
        raise SampleError(UNKNOWN_ROLE, f"{where}: unknown role {excerpt(role_raw)}")
    content = _text(raw["content"] if "content" in raw else raw.get("value"), where)
    reasoning = None
    for name in REASONING_FIELDS:
        if raw.get(name) is not None:
            reasoning = _text(raw[name], f"{where}.{name}")
            break
    msg = {"role": role, "content": content, "reasoning": reasoning if role == "assistant" else None}
    for name in PASSTHROUGH_FIELDS:
        if raw.get(name) is not None:
            msg[name] = raw[name]
    return msg


def parse_line(line: bytes | str, default_id: str) -> Sample:
    """Parse one JSONL line (UTF-8, a leading byte order mark allowed) into a :class:`Sample` (raises
    :class:`SampleError`)."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SampleError(INVALID_UTF8, f"not valid UTF-8 (byte 0x{line[exc.start]:02x} at offset {exc.start})") from None
    line = line.removeprefix("\ufeff")
    try:
        obj = json.loads(line)
    except RecursionError:
        raise SampleError(MALFORMED_JSON, "JSON nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SampleError(MALFORMED_JSON, f"not valid JSON ({short_detail(str(exc))})") from None
    return parse_record(obj, default_id)


def parse_record(obj, default_id: str) -> Sample:
    """A decoded record (a JSON line's object, a JSON-array element, a Parquet/Arrow row) as a
    :class:`Sample` (raises :class:`SampleError`)."""
    if not isinstance(obj, dict):
        raise SampleError(NOT_AN_OBJECT, f"expected a JSON object, got {type(obj).__name__}")
    sid = record_id(obj, default_id)
    raw_msgs = record_messages(obj)
    if raw_msgs is None:
        raise SampleError(NO_MESSAGES, "no 'messages' or 'conversations' field", sid)
    if not isinstance(raw_msgs, list):
        raise SampleError(BAD_MESSAGE, f"'messages' must be a list, got {type(raw_msgs).__name__}", sid)
    if not raw_msgs:
        raise SampleError(EMPTY_CONVERSATION, "the conversation has no messages", sid)
    try:
        messages = [normalise_message(m, i) for i, m in enumerate(raw_msgs)]
    except SampleError as exc:
        exc.sample_id = sid
        raise
    except (RecursionError, ValueError, TypeError, AttributeError) as exc:
        raise SampleError(BAD_MESSAGE, f"cannot read the messages ({type(exc).__name__})", sid) from None
    if not any(m["role"] == "assistant" for m in messages):
        raise SampleError(NO_ASSISTANT_TURN, "the conversation has no assistant turn", sid)
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise SampleError(BAD_MESSAGE, f"'tools' must be a list of tool definitions, got {type(tools).__name__}", sid)
    return Sample(sid, messages, tools)
