"""Text that reaches a terminal: control characters taken out.

Job errors quote what users supplied (file names, tensor names, URIs); a terminal that prints an
escape sequence from one may change its title, clear its screen or hide text. :func:`printable`
removes C0 and C1 control characters (ESC, CSI, BEL, CR, DEL, ...) and the Unicode bidirectional
controls that reorder what is shown; newlines and tabs stay where ``keep`` says so.
"""

from __future__ import annotations

import re

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROLS = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")
_CONTROLS_AND_BREAKS = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}\u2028\u2029]")


def printable(text: str, *, keep_newlines: bool = True) -> str:
    """``text`` without control characters (with ``keep_newlines``, newlines and tabs kept)."""
    return (_CONTROLS if keep_newlines else _CONTROLS_AND_BREAKS).sub("", text)


def printable_tree(value):
    """A JSON value (dicts, lists, strings, numbers) with :func:`printable` applied to every string, keys
    included."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_tree(v) for v in value]
    return value
