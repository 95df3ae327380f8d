"""Spec fields that choose an operator-configured endpoint by name, never by address.

A worker sends its credentials (and a job's data) only to addresses its operator configured; a spec
can only pick one of them by name. A name is letters, digits, ``_``, ``.`` and ``-``, so no URL or
host:port fits, and a removed address field is refused with what to use instead.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

DEFAULT = "default"
"""The endpoint a spec gets when it names none: the worker's plain setting (e.g. DFLASH_TARGET_URL)."""
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)


def is_endpoint_name(value: object) -> bool:
    return isinstance(value, str) and _NAME_RE.fullmatch(value) is not None


def endpoint_name(what: str):
    """The type of a spec field naming one of the operator's ``what`` (e.g. "OpenAI-compatible endpoint")."""

    def check(value: Any) -> Any:
        if isinstance(value, str) and not is_endpoint_name(value):
            raise ValueError(f"{value!r} is not the name of a configured {what}: give one of the names the "
                             f"operator configured (letters, digits, '_', '.', '-'; at most 64), never an address")
        return value

    # the constraints first, so the schema states them; the validator wraps them and runs first
    return Annotated[str, Field(pattern=NAME_PATTERN, max_length=64), BeforeValidator(check)]


def refuse_removed(data: Any, removed: str, instead: str, why: str) -> Any:
    """Refuse the removed field ``removed`` of a spec's raw ``data``, saying what to use instead."""
    if isinstance(data, dict) and removed in data:
        raise ValueError(f"{removed}: no longer accepted ({why}); name one the operator configured with "
                         f"{instead} instead (unset: 'default')")
    return data


def removed_address(removed: str, instead: str, why: str):
    """A spec's ``model_validator(mode="before")`` refusing the removed address field ``removed`` (see
    :func:`refuse_removed`); assign it to a class attribute of the spec."""
    return model_validator(mode="before")(classmethod(lambda cls, data: refuse_removed(data, removed, instead, why)))


def load_name_map(text: str, what: str, value: str) -> dict[str, Any]:
    """An operator's JSON object of ``what`` name -> ``value`` (e.g. DFLASH_TARGET_ENDPOINTS); ``default``
    is the plain setting, not an entry. Raises ValueError naming the entry and the reason."""
    if not text.strip():
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a JSON object of name -> {value} ({exc.msg} at char {exc.pos})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"not a JSON object of name -> {value}")
    for name in raw:
        if not is_endpoint_name(name):
            raise ValueError(f"{what} name {name!r}: use letters, digits, '_', '.', '-' (at most 64)")
    return raw
