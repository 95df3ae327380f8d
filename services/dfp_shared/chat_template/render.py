"""Rendering a conversation with a chat template, in the sized sandbox, as ``apply_chat_template`` does.

:func:`compile_template` compiles a template in a private copy of transformers' sandboxed Jinja
environment that refuses any single operation making more than ``max_chars`` characters (see
:mod:`.sandbox`). :func:`render_chat` renders a conversation with a tokenizer's template (or a
template's text) and gives the same text as ``tokenizer.apply_chat_template(messages,
tokenize=False, ...)``: the template sees the same variables (the tokenizer's special tokens, the
caller's keyword arguments, ``tools`` and ``documents``) and the same messages (keys whose value is
None dropped, rebuilt from plain JSON types, the reasoning aliased as ``reasoning_content`` and
``thinking``). :func:`chat_prompt_ids` tokenizes the rendered prompt (no special tokens added: the
template prints them).

Without a ``budget`` a render runs in the caller's thread as it is (the size checks cost little);
with one it runs under :func:`.budget.run_within`. An operation refused by the sandbox, or a render
over its budget, raises :class:`TemplateOverBudget` (an ordinary exception, unlike the
:class:`~.budget.BudgetExceeded` it replaces).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from dfp_shared.chat_template.budget import BudgetExceeded, run_within
from dfp_shared.chat_template.sandbox import sized_copy

DEFAULT_MAX_CHARS = 16 * 2**20
"""The longest text (and single operation's result) a render may make, by default."""

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateOverBudget(RuntimeError):
    """A render was refused by the sandbox or stopped by its budget."""


@dataclasses.dataclass(frozen=True)
class RenderBudget:
    seconds: float
    memory_bytes: int


def compile_template(template: str, max_chars: int):
    """``template`` compiled by a sized copy of transformers' sandboxed Jinja environment, with the
    sandbox's attribute check memoised: jinja's immutable sandbox decides from the object's type and
    the attribute name only, never from the value."""
    try:
        from transformers.utils.chat_template_utils import _cached_compile_jinja_template as compile_
    except ImportError:  # pragma: no cover - older transformers
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_
    # the template is compiled by the checked copy only: compiling folds constant expressions
    env = sized_copy(compile_("").environment, max_chars)
    check = env.is_safe_attribute
    memo: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj, attr, value):
        key = (type(obj), attr)
        safe = memo.get(key)
        if safe is None:
            safe = memo[key] = check(obj, attr, value)
        return safe

    env.is_safe_attribute = is_safe_attribute
    return env.from_string(template)


@lru_cache(maxsize=32)
def compiled(template: str, max_chars: int = DEFAULT_MAX_CHARS):
    """:func:`compile_template`, once per template and size."""
    return compile_template(template, max_chars)


def template_of(tokenizer_or_template, tools: list | None = None) -> str:
    """The template's text: given as a string, or the tokenizer's (its ``tool_use`` one when tools are given
    and it has one, as ``apply_chat_template`` picks)."""
    if isinstance(tokenizer_or_template, str):
        return tokenizer_or_template
    get = getattr(tokenizer_or_template, "get_chat_template", None)
    if get is not None:
        return get(None, tools)
    template = tokenizer_or_template.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use" if tools else "default") or template.get("default")
    if not template:
        raise ValueError("the tokenizer has no chat template")
    return template


def render_chat(tokenizer_or_template, messages: list, *, add_generation_prompt: bool = False,
                enable_thinking: bool | None = None, template_kwargs: dict | None = None, tools: list | None = None,
                documents: list | None = None, max_chars: int = DEFAULT_MAX_CHARS,
                budget: RenderBudget | None = None) -> str:
    """The conversation as the chat template prints it: ``tokenizer.apply_chat_template(messages,
    tokenize=False, add_generation_prompt=..., enable_thinking=..., tools=..., **template_kwargs)``.
    ``enable_thinking`` None passes no such variable (the template's default)."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    template = compiled(template_of(tokenizer_or_template, tools), max_chars)
    kwargs = dict(template_kwargs or {})
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    specials = {} if isinstance(tokenizer_or_template, str) else dict(tokenizer_or_template.special_tokens_map)
    variables = plain({**specials, **kwargs})
    chat = alias_reasoning(plain([{k: v for k, v in _as_dict(m).items() if v is not None} for m in messages]))
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    args = dict(messages=chat, tools=plain(tool_schemas(tools)), documents=plain(documents),
                add_generation_prompt=add_generation_prompt, **variables)
    try:
        if budget is None:
            return template.render(**args)
        return run_within(lambda: template.render(**args), seconds=budget.seconds, memory_bytes=budget.memory_bytes)
    except BudgetExceeded as exc:
        raise TemplateOverBudget(str(exc)) from None


def chat_prompt_ids(tokenizer, messages: list, *, enable_thinking: bool | None = None,
                    add_generation_prompt: bool = True, **options) -> list[int]:
    """The token ids of the rendered prompt (by default with the generation prompt appended)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                       enable_thinking=enable_thinking, **options)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# what the template sees, as transformers builds it


def tool_schemas(tools: list | None) -> list | None:
    """Tools as JSON schemas (a Python function with type hints and a docstring becomes its schema)."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict):
            out.append(tool)
        elif callable(tool):
            from transformers.utils import get_json_schema

            out.append(get_json_schema(tool))
        else:
            raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                             "and a docstring suitable for auto-conversion to a schema.")
    return out


def alias_reasoning(chat: list[dict]) -> list[dict]:
    """A message's reasoning under any of its names is also ``reasoning_content`` and ``thinking``."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (subclasses stripped to their base type, dataclasses and
    pydantic models as dicts); anything else becomes an inert placeholder naming its type (``<ndarray>``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if _is_numpy_scalar(value):  # ``np.bool_(False)`` would otherwise be a truthy placeholder
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _is_numpy_scalar(value) -> bool:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, np.generic)


def _as_dict(message) -> dict:
    """A message given as a dict, dataclass or pydantic model, as a dict (nested objects too)."""
    if isinstance(message, Mapping):
        return dict(message)
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    dump: Callable | None = getattr(message, "model_dump", None)
    if callable(dump):
        return dump()
    raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
