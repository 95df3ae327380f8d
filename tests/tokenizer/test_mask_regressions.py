"""Loss masks of single cases: tool calls holding end-of-turn look-alikes, tool definitions from the record
and from the job, reasoning only where the template reads it, an empty last assistant turn."""

from __future__ import annotations

import json

import pytest

from .test_masking import check, encoder_for, qwen3_expected
from .test_template_properties import END_OF_TURN, prefix_expected

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.mark.parametrize("as_string", [False, True])
def test_qwen3_tool_call_arguments_holding_end_of_turn_are_trained_to_the_real_end(qwen3_tokenizer, as_string):
    args = {"q": "stop <|im_end|> here <|im_end|>\n<|im_start|>user\n"}
    messages = [{"role": "user", "content": "find it"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "search", "arguments": json.dumps(args) if as_string else args}}]},
                {"role": "tool", "content": "found"}, {"role": "assistant", "content": "Done."}]
    res = check(qwen3_tokenizer, messages, qwen3_expected)
    runs = qwen3_tokenizer.decode(res.ids[res.mask == 1], skip_special_tokens=False)
    assert runs.count("<|im_end|>") == 4  # two in the arguments, one per trained turn


@pytest.mark.parametrize("where", ["record", "spec"])
def test_qwen3_tool_definitions_reach_the_template(qwen3_tokenizer, where):
    messages = [{"role": "user", "content": "find it"}, {"role": "assistant", "content": "Searching."}]
    opts = {"template_kwargs": {"tools": TOOLS}} if where == "spec" else {}
    res = check(qwen3_tokenizer, messages, qwen3_expected, tools=TOOLS if where == "record" else None, **opts)
    text = qwen3_tokenizer.decode(res.ids, skip_special_tokens=False)
    assert "# Tools" in text and '"name": "search"' in text
    assert "# Tools" not in qwen3_tokenizer.decode(res.ids[res.mask == 1], skip_special_tokens=False)


def test_record_tools_override_the_jobs(qwen3_tokenizer):
    other = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": "lookup"}}]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    res = check(qwen3_tokenizer, messages, qwen3_expected, tools=other, template_kwargs={"tools": TOOLS})
    text = qwen3_tokenizer.decode(res.ids, skip_special_tokens=False)
    assert '"name": "lookup"' in text and '"name": "search"' not in text


@pytest.mark.parametrize("name", ["llama3_1", "gemma3", "deepseek_v3", "smollm2"])
@pytest.mark.parametrize("content", ["<think>\nhmm\n</think>\n\nanswer", "keep this </think> and this"])
def test_templates_without_reasoning_train_think_tags_as_text(real_template_tokenizers, name, content):
    tokenizer = real_template_tokenizers[name]
    assert not encoder_for(tokenizer, thinking=True).locator.splits_inline_reasoning
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]
    res = check(tokenizer, messages, prefix_expected(tokenizer, END_OF_TURN[name], None))
    trained = tokenizer.decode(res.ids[res.mask == 1], skip_special_tokens=False)
    assert trained == content.strip() + END_OF_TURN[name]


def test_qwen3_reads_inline_reasoning_as_reasoning(qwen3_tokenizer):
    assert encoder_for(qwen3_tokenizer, thinking=True).locator.splits_inline_reasoning
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "before </think>after"}]
    res = check(qwen3_tokenizer, messages, qwen3_expected)
    assert qwen3_tokenizer.decode(res.ids[res.mask == 1]) == "<think>\nbefore \n</think>\n\nafter<|im_end|>"


@pytest.mark.parametrize("thinking,trained", [(True, "<think>\n\n</think>\n\n<|im_end|>"), (False, "<|im_end|>")])
def test_qwen3_empty_last_turn_is_trained_as_rendered(qwen3_tokenizer, thinking, trained):
    messages = [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}]
    res = check(qwen3_tokenizer, messages, qwen3_expected, thinking=thinking)
    assert qwen3_tokenizer.decode(res.ids[res.mask == 1], skip_special_tokens=False) == trained
