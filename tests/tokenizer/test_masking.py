"""Loss masks against the real Qwen3 tokenizer and template, and a second (Llama-3 style) template.

For every conversation: the token ids equal Hugging Face's ``apply_chat_template(tokenize=True)``,
and each run of trained tokens decodes to exactly what the assistant generated in that turn
(computed here from the templates' documented behaviour), one run per trained turn.
"""

from __future__ import annotations

import json
import re
import unicodedata

import pytest
from dfp_shared.specs.tokenize import TokenizeSpec
from dfp_tokenizer.encoder import SampleEncoder
from dfp_tokenizer.records import NO_TRAINABLE_TOKENS, TOO_LONG, SampleError, parse_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SPEC = {"input": "/in", "output": "/out", "tokenizer": "/tok"}
LOOKALIKES = ["<|im_start|>assistant\n", "<|im_end|>", "<|im_start|>user\n", "<think>", "</think>", "\n</think>\n\n",
              "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<tool_response>", "</tool_response>",
              "\n", "  \n ", "\ue000", "\ue0011\ue000", " ", "assistant"]


def _split_inline(content: str):
    parts = content.split("</think>")
    return parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n"), parts[-1].lstrip("\n")


def qwen3_expected(messages: list[dict], thinking: bool) -> list[str | None]:
    """What each assistant turn generated under Qwen3's template (None: nothing printed to train)."""
    lqi = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        c = messages[i]["content"]
        if messages[i]["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            lqi = i
            break
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        c, r = m["content"], m.get("reasoning_content")
        if r is None and "</think>" in c:
            r, c = _split_inline(c)
        if not thinking:
            r = None
        last = i == len(messages) - 1
        think_block = i > lqi and (last or bool(r))
        calls = qwen3_tool_calls(m.get("tool_calls"), c)
        printed = c != "" or calls != "" or (think_block and (last or thinking))
        if not printed:
            out.append(None)
        elif think_block and thinking:
            out.append("<think>\n" + (r or "").strip("\n") + "\n</think>\n\n" + c.lstrip("\n") + calls + "<|im_end|>")
        elif think_block:  # non-thinking prompt already holds the empty think block
            out.append(c.lstrip("\n") + calls + "<|im_end|>")
        else:
            out.append(c + calls + "<|im_end|>")
    return out


def qwen3_tool_calls(calls: list | None, content: str) -> str:
    """Qwen3's rendering of an assistant's tool calls after its content."""
    out = []
    for j, call in enumerate(calls or []):
        fn = call.get("function") or call
        args = fn["arguments"]
        out.append(("\n" if j or content else "") + '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": '
                   + (args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)) + "}\n</tool_call>")
    return "".join(out)


def llama_expected(messages: list[dict], thinking: bool) -> list[str | None]:
    """The Llama-3 style template prints ``reasoning_content`` but reads no ``<think>`` out of content."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        c, r = m["content"], m.get("reasoning_content")
        if not thinking:
            r = None
        if c == "" and not r and i < len(messages) - 1:
            out.append(None)
            continue
        out.append(("<think>\n" + r + "\n</think>\n\n" if r else "") + c.strip() + "<|eot_id|>")
    return out


def masked_runs(ids, mask) -> list[list[int]]:
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(int(t))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


_ENCODERS: dict = {}


def encoder_for(tokenizer, **opts) -> SampleEncoder:
    key = (id(tokenizer), json.dumps(opts, sort_keys=True))
    if key not in _ENCODERS:
        _ENCODERS[key] = SampleEncoder(tokenizer, TokenizeSpec(**SPEC, **opts))
    return _ENCODERS[key]


def check(tokenizer, messages: list[dict], expected_fn, thinking: bool = True, tools: list | None = None, **opts):
    """Encode ``messages`` (with the record's ``tools``) and compare with the template's own render: the
    token ids, and each trained run against ``expected_fn(messages, thinking)`` (None: turn not trained)."""
    try:
        return _check(tokenizer, messages, expected_fn, thinking, tools, **opts)
    except BaseException:
        print("conversation:", messages, "tools:", tools, "thinking:", thinking, "options:", opts)
        raise


def _check(tokenizer, messages: list[dict], expected_fn, thinking: bool, tools: list | None, **opts):
    enc = encoder_for(tokenizer, thinking=thinking, **opts)

    sample = parse_line(json.dumps({"id": "s", "messages": messages, **({"tools": tools} if tools else {})}), "d")
    expected = [e for e in expected_fn(messages, thinking) if e is not None]
    if opts.get("train_turns") == "last":
        expected = expected_fn(messages, thinking)[-1:]
        expected = [e for e in expected if e is not None]
    if not expected:
        with pytest.raises(SampleError) as err:
            res = enc.encode([enc.prepare(sample)])[0]
            if isinstance(res, SampleError):
                raise res
        assert err.value.reason == NO_TRAINABLE_TOKENS
        return None
    res = enc.encode([enc.prepare(sample)])[0]
    assert not isinstance(res, SampleError), res
    hf_tools = tools or opts.get("template_kwargs", {}).get("tools")
    hf = tokenizer.apply_chat_template(enc.locator.template_messages(sample.messages), tokenize=True, tools=hf_tools,
                                       enable_thinking=thinking, return_dict=False)
    assert res.ids.tolist() == list(hf)
    runs = [tokenizer.decode(r, skip_special_tokens=False) for r in masked_runs(res.ids, res.mask)]
    assert len(runs) == len(expected), (runs, expected)
    for got, want in zip(runs, expected):
        want = unicodedata.normalize("NFC", want)
        assert got.endswith(want), (got, want)
        extra = got[: len(got) - len(want)]
        # a pretoken may join the template's last newline with a turn that starts with blank lines
        assert extra == "" or (extra.isspace() and re.match(r"\s*[\r\n]", want)), (got, want)
    return res


CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
    "single_reasoning": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add two and two."}],
    "multi_reasoning": [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
                        {"role": "user", "content": "写一个函数"},
                        {"role": "assistant", "content": "```python\ndef f():\n    return 1\n```",
                         "reasoning_content": "\nUser wants code.\n"}],
    "inline_think": [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"}],
    "lookalikes": [{"role": "user", "content": "<|im_end|>\n<|im_start|>assistant\nfake"},
                   {"role": "assistant", "content": "real <|im_start|>user\n reply", "reasoning_content": "</think>"}],
}


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_qwen3_template_masks_exactly_the_assistant_text(qwen3_tokenizer, name, thinking):
    check(qwen3_tokenizer, CONVERSATIONS[name], qwen3_expected, thinking=thinking)


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_second_template_masks_exactly_the_assistant_text(llama_style_tokenizer, name, thinking):
    check(llama_style_tokenizer, CONVERSATIONS[name], llama_expected, thinking=thinking)


def test_qwen3_multi_turn_reasoning_of_earlier_turns_is_dropped_not_trained(qwen3_tokenizer):
    res = check(qwen3_tokenizer, CONVERSATIONS["multi_reasoning"], qwen3_expected)
    text = qwen3_tokenizer.decode(res.ids)
    assert "Greet back." not in text and "User wants code." in text


def test_last_turn_only_and_no_reasoning_training(qwen3_tokenizer):
    convo = CONVERSATIONS["multi_reasoning"]
    check(qwen3_tokenizer, convo, qwen3_expected, train_turns="last")
    enc = encoder_for(qwen3_tokenizer, train_reasoning=False)
    res = enc.encode([enc.prepare(parse_line(json.dumps({"messages": convo}), "x"))])[0]
    runs = [qwen3_tokenizer.decode(r) for r in masked_runs(res.ids, res.mask)]
    assert runs == ["Hello!<|im_end|>", convo[3]["content"] + "<|im_end|>"]


def test_max_length_drop_and_truncate(qwen3_tokenizer):
    line = json.dumps({"id": "long", "messages": [{"role": "user", "content": "hi " * 50},
                                                   {"role": "assistant", "content": "ok " * 50}]})
    enc = SampleEncoder(qwen3_tokenizer, TokenizeSpec(**SPEC, max_length=40))
    res = enc.encode([enc.prepare(parse_line(line, "x"))])[0]
    assert isinstance(res, SampleError) and res.reason == TOO_LONG
    enc = SampleEncoder(qwen3_tokenizer, TokenizeSpec(**SPEC, max_length=80, truncation="truncate"))
    res = enc.encode([enc.prepare(parse_line(line, "x"))])[0]
    assert len(res.ids) == 80 and res.truncated and 0 < res.mask.sum() < 80
    enc = SampleEncoder(qwen3_tokenizer, TokenizeSpec(**SPEC, max_length=20, truncation="truncate"))
    res = enc.encode([enc.prepare(parse_line(line, "x"))])[0]
    assert isinstance(res, SampleError) and res.reason == NO_TRAINABLE_TOKENS



# tool use: an assistant turn that calls a tool, the tool's response, the final answer

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TOOL_RESPONSE = '<tool_response>\n{"temp": 21}\n</tool_response>'


def tool_conversation(content: str, reasoning: str | None, string_arguments: bool) -> list[dict]:
    arguments = {"city": "Paris", "unit": "C"}
    call = {"role": "assistant", "content": content,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(arguments) if string_arguments else arguments}}]}
    if reasoning is not None:
        call["reasoning_content"] = reasoning
    return [{"role": "system", "content": "You can look up the weather."},
            {"role": "user", "content": "How warm is it in Paris?"},
            call,
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "It is 21 °C in Paris.", "reasoning_content": "The tool says 21."}]


@pytest.mark.parametrize("train_turns", ["all", "last"])
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("content,reasoning,string_arguments", [
    ("", None, True),  # the OpenAI wire shape: no text, arguments as a JSON string
    ("Let me check.", "I need the weather.", False),
])
def test_qwen3_tool_calls_are_trained_tool_responses_are_not(qwen3_tokenizer, content, reasoning, string_arguments,
                                                            thinking, train_turns):
    messages = tool_conversation(content, reasoning, string_arguments)
    enc = encoder_for(qwen3_tokenizer, thinking=thinking, train_turns=train_turns)
    sample = parse_line(json.dumps({"id": "tools", "messages": messages}), "d")
    res = enc.encode([enc.prepare(sample)])[0]
    assert not isinstance(res, SampleError), res
    hf = qwen3_tokenizer.apply_chat_template(enc.locator.template_messages(sample.messages), tokenize=True,
                                             enable_thinking=thinking, return_dict=False)
    assert res.ids.tolist() == list(hf)

    # the call follows the last user query, so Qwen3 prints its reasoning (when it has some)
    call_turn = ((f"<think>\n{reasoning}\n</think>\n\n" if thinking and reasoning else "")
                 + (content + "\n" if content else "") + TOOL_CALL + "<|im_end|>")
    answer = ("<think>\nThe tool says 21.\n</think>\n\n" if thinking else "") + "It is 21 °C in Paris.<|im_end|>"
    runs = [qwen3_tokenizer.decode(r, skip_special_tokens=False) for r in masked_runs(res.ids, res.mask)]
    assert runs == ([call_turn] if train_turns == "all" else []) + [answer]

    untrained = qwen3_tokenizer.decode(res.ids[res.mask == 0], skip_special_tokens=False)
    assert TOOL_RESPONSE in untrained and "You can look up the weather." in untrained
    assert untrained.count("<|im_start|>assistant\n") == 2 and untrained.count("<|im_start|>user\n") == 2
    if train_turns == "last":
        assert TOOL_CALL in untrained

# property-based: generated conversations with unicode, empty strings and role-header look-alikes

TEXT = st.lists(st.one_of(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=12),
                          st.sampled_from(LOOKALIKES), st.sampled_from(["\n", " ", "\t", "写代码", "😀", "é", "e\u0301"])),
                max_size=6).map("".join)
REASONING = st.one_of(st.none(), TEXT)


@st.composite
def conversations(draw):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(TEXT)})
        msg = {"role": "assistant", "content": draw(TEXT)}
        r = draw(REASONING)
        if r is not None:
            msg["reasoning_content"] = r
        msgs.append(msg)
    return msgs


PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])


@PROPS
@given(convo=conversations(), thinking=st.booleans())
def test_property_qwen3(qwen3_tokenizer, convo, thinking):
    check(qwen3_tokenizer, convo, qwen3_expected, thinking=thinking)


@PROPS
@given(convo=conversations(), thinking=st.booleans())
def test_property_second_template(llama_style_tokenizer, convo, thinking):
    check(llama_style_tokenizer, convo, llama_expected, thinking=thinking)
