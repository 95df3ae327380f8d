"""The shared renderer gives exactly what ``apply_chat_template`` gives, and keeps the sandbox's refusals.

Compared on the real Qwen3 tokenizer in thinking and non-thinking mode, with and without the
generation prompt, with reasoning given apart or inline, tool calls and tools.
"""

from __future__ import annotations

import pytest
from dfp_shared.chat_template import (
    RenderBudget,
    TemplateOverBudget,
    chat_prompt_ids,
    render_chat,
)

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a word.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "Write a Python function that reverses a linked list."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2 + 2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke.\n\n  With trailing spaces  "}],
    [{"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "<think>\nLet me think.\n</think>\n\nBecause."},
     {"role": "user", "content": "And then?"}],
    [{"role": "user", "content": "Plan it"},
     {"role": "assistant", "content": "Done.", "reasoning_content": "First step, then second.", "name": None},
     {"role": "user", "content": "ünïcødé ✓ 漢字 \U0001f600"}],
    [{"role": "user", "content": "Look up 'ewe'"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                          "function": {"name": "lookup", "arguments": {"q": "ewe"}}}]},
     {"role": "tool", "content": "a female sheep"}],
]


@pytest.fixture(scope="module")
def tokenizer(qwen3_tokenizer_dir):
    from dfp_shared.models.tokenizer_assets import load_tokenizer

    return load_tokenizer(qwen3_tokenizer_dir)


@pytest.mark.parametrize("thinking", [True, False, None])
@pytest.mark.parametrize("prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_renders_exactly_as_apply_chat_template(tokenizer, thinking, prompt, with_tools):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    tools = TOOLS if with_tools else None
    for messages in CONVERSATIONS:
        expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt, tools=tools,
                                                 **kwargs)
        got = render_chat(tokenizer, messages, add_generation_prompt=prompt, enable_thinking=thinking, tools=tools)
        assert got == expected
        assert render_chat(tokenizer, messages, add_generation_prompt=prompt, template_kwargs=kwargs,
                           tools=tools) == expected


@pytest.mark.parametrize("thinking", [True, False])
def test_prompt_ids_are_apply_chat_templates_tokens(tokenizer, thinking):
    for messages in CONVERSATIONS:
        expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 enable_thinking=thinking, return_dict=False)
        assert chat_prompt_ids(tokenizer, messages, enable_thinking=thinking) == list(expected)


def test_a_template_text_and_the_caller_messages_untouched(tokenizer):
    messages = [{"role": "user", "content": "hi", "reasoning": "r"}]
    before = [dict(m) for m in messages]
    text = render_chat(tokenizer.chat_template, messages, add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert messages == before
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat(tokenizer, [])


def test_oversized_operations_and_runaway_renders_are_ordinary_errors():
    bomb = "{{ 'a' * 10**9 }}"
    with pytest.raises(TemplateOverBudget, match=r"refused '\*' on a str before it ran"):
        render_chat(bomb, [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateOverBudget, match="joining the rendered text"):
        render_chat("{{ messages[0].content }}", [{"role": "user", "content": "x" * 2000}], max_chars=1000)
    loop = "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateOverBudget, match="ran past its time budget of 0.2 s"):
        render_chat(loop, [{"role": "user", "content": "x"}], budget=RenderBudget(0.2, 512 * 2**20))
    assert render_chat("{{ messages|length }}", [{"role": "user", "content": "x"}],
                       budget=RenderBudget(2.0, 512 * 2**20)) == "1"


def test_strftime_now_prints_plain_dates_and_refuses_widths_before_it_runs():
    import datetime

    from dfp_shared.chat_template.render import TemplateOverBudget, render_chat

    msgs = [{"role": "user", "content": "hi"}]
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert render_chat("{{ strftime_now('%d %b %Y') }}", msgs) in (today, datetime.datetime.now().strftime("%d %b %Y"))
    for bad in ("{{ strftime_now('%1000000000d') }}", "{{ strftime_now('%_9Y') }}", "{{ strftime_now('50%') }}",
                "{{ 'a'|urlize }}", "{{ lipsum() }}"):
        with pytest.raises(TemplateOverBudget, match="before it ran"):
            render_chat(bad, msgs)
