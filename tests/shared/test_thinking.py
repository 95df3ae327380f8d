"""The two ``<think>`` splits: generated text (generation) and an assistant's content (tokenizer)."""

from __future__ import annotations

import pytest
from dfp_shared.records.thinking import split_inline_reasoning, split_thinking


@pytest.mark.parametrize("text, expected", [
    ("<think>\nplan\n</think>\n\nanswer", ("plan", "answer", True)),
    ("plan\n</think>\n\nanswer", ("plan", "answer", True)),  # template opened <think> in the prompt
    ("<think>\nstill thinking", ("still thinking", "", False)),
    ("just an answer", (None, "just an answer", True)),
    ("<think>\n\n</think>\n\nno thoughts", ("", "no thoughts", True)),
    ("a<think>b", (None, "a<think>b", True)),  # text before <think>: all answer
    ("\n<think>b\n", ("b", "", False)),
    ("<think>a<think>b</think>c", ("a<think>b", "c", True)),  # only the first <think> opens
    ("a</think>b</think>c", ("a", "b</think>c", True)),  # only the first </think> closes
    ("\n\nr\n\n</think>\n\n\nc\n", ("r", "c\n", True)),
])
def test_split_thinking(text, expected):
    assert split_thinking(text) == expected


@pytest.mark.parametrize("content, expected", [
    ("<think>\nr\n</think>\n\nc", ("r", "c")),
    ("r\n</think>\n\nc", ("r", "c")),
    ("no tags", (None, "no tags")),
    ("<think>\nunclosed", (None, "<think>\nunclosed")),  # without </think> nothing is split
    ("<think>a<think>b</think>c", ("b", "c")),  # the last <think> before </think> opens
    ("a</think>b</think>c", ("a", "c")),  # the content after the last </think> is kept
    ("\n\nr\n\n</think>\n\n\nc\n", ("r", "c\n")),  # newlines stripped at the inner edges only
    ("<think></think>", ("", "")),
])
def test_split_inline_reasoning(content, expected):
    assert split_inline_reasoning(content) == expected
