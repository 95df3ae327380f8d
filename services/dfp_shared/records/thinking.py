"""The ``<think>`` block: splitting generated text or an assistant's content into reasoning and answer."""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def split_thinking(text: str) -> tuple[str | None, str, bool]:
    """Split a model's generated text into (reasoning, answer, reasoning_closed).

    Handles ``<think>R</think>A``, templates that open ``<think>`` in the prompt (output ``R</think>A``),
    and thinking cut off before ``</think>`` (reasoning_closed False, answer empty). Text without
    think tags is all answer (reasoning None). Only the first ``</think>`` ends the reasoning.
    """
    if THINK_CLOSE in text:
        before, _, after = text.partition(THINK_CLOSE)
        if THINK_OPEN in before:
            before = before.split(THINK_OPEN, 1)[1]
        return before.strip("\n"), after.lstrip("\n"), True
    if THINK_OPEN in text:
        head, _, rest = text.partition(THINK_OPEN)
        if not head.strip():
            return rest.strip("\n"), "", False
    return None, text, True


def split_inline_reasoning(content: str) -> tuple[str | None, str]:
    """``"<think>r</think>c"`` -> ``("r", "c")`` the way Qwen3's chat template splits an assistant's
    content: reasoning after the last ``<think>`` before the first ``</think>``, content after the last
    ``</think>``. Without ``</think>``: ``(None, content)``."""
    if THINK_CLOSE not in content:
        return None, content
    parts = content.split(THINK_CLOSE)
    reasoning = parts[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
    return reasoning, parts[-1].lstrip("\n")
