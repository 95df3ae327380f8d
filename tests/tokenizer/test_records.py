"""Input shapes and per-line reasons."""

from __future__ import annotations

import json

import pytest
from dfp_tokenizer.files import shard_name
from dfp_tokenizer.records import SampleError, parse_line


def test_completion_record_shape():
    s = parse_line(json.dumps({"id": "a1", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "c", "reasoning_content": "r"}],
        "meta": {"model": "m"}}), "f:1")
    assert s.id == "a1"
    assert s.messages[1] == {"role": "assistant", "content": "c", "reasoning": "r"}


def test_sharegpt_and_role_content_conversations():
    s = parse_line(json.dumps({"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q"},
                                                 {"from": "gpt", "value": "<think>\nr\n</think>\n\nc"}]}), "f:7")
    assert s.id == "f:7"
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant"]
    # inline reasoning stays in the content: the chat template locator splits it where the template does
    assert s.messages[2]["reasoning"] is None and s.messages[2]["content"] == "<think>\nr\n</think>\n\nc"
    s = parse_line(json.dumps({"conversations": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                               {"type": "text", "text": "b"}]},
                                                 {"role": "assistant", "content": "x", "thinking": "t"}]}), "f:2")
    assert s.messages[0]["content"] == "ab" and s.messages[1]["reasoning"] == "t"


@pytest.mark.parametrize("line,reason", [
    ("{not json", "malformed_json"),
    ("[1, 2]", "not_an_object"),
    ('{"id": "x"}', "no_messages"),
    ('{"messages": []}', "empty_conversation"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "unknown_role"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no_assistant_turn"),
    ('{"messages": [{"role": "user", "content": {"a": 1}}, {"role": "assistant", "content": "y"}]}', "bad_message"),
    ('{"messages": ["hello"]}', "bad_message"),
])
def test_bad_lines_have_a_reason(line, reason):
    with pytest.raises(SampleError) as err:
        parse_line(line, "f:1")
    assert err.value.reason == reason


def test_shard_names_are_deterministic_and_distinct():
    assert shard_name("a/x.jsonl") == shard_name("a/x.jsonl")
    assert shard_name("a/x.jsonl") != shard_name("b/x.jsonl")
    assert shard_name("completions/shard-00001.jsonl").startswith("completions--shard-00001-")
