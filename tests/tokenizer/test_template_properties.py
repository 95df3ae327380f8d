"""Loss masks on real chat templates (Qwen3, Llama 3.1, Gemma 3, DeepSeek V3, SmolLM2) over generated conversations
with tool calls, tool definitions, reasoning and special-token look-alikes inside contents and arguments.

For each conversation: ``input_ids`` equal the tokenized full render of the template, and each trained run
decodes to the text its assistant turn occupies in that render. For Qwen3 (which drops earlier turns'
reasoning) that text comes from the template's documented behaviour (``qwen3_expected``); the other three
render each turn the same whatever follows, so a turn's text is the render up to that turn less the render
before it with the generation prompt, up to its end-of-turn token.
"""

from __future__ import annotations

import json

import pytest
from dfp_tokenizer.records import TEMPLATE_ERROR, SampleError, parse_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import REAL_TEMPLATES
from .test_masking import LOOKALIKES, check, encoder_for, qwen3_expected

END_OF_TURN = {"llama3_1": "<|eot_id|>", "gemma3": "<end_of_turn>", "deepseek_v3": "<｜end▁of▁sentence｜>",
              "smollm2": "<|im_end|>"}
SPECIALS = sorted({*LOOKALIKES, *END_OF_TURN.values(), "<start_of_turn>model\n", "<｜Assistant｜>", "<｜User｜>",
                   "<tool_call>", "</tool_call>"})
TEXT = st.lists(st.one_of(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=8),
                          st.sampled_from(SPECIALS), st.sampled_from(["\n", " ", "写代码", "😀"])), max_size=4).map("".join)
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a fact <|im_end|>",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@st.composite
def tool_call(draw):
    args = {"q": draw(st.one_of(TEXT, st.sampled_from(SPECIALS))), "n": draw(st.integers(0, 9))}
    return {"type": "function", "function": {"name": draw(st.sampled_from(["lookup", "get_weather"])),
                                             "arguments": json.dumps(args, ensure_ascii=False)
                                             if draw(st.booleans()) else args}}


@st.composite
def assistant_turn(draw):
    msg = {"role": "assistant", "content": draw(TEXT)}
    kind = draw(st.sampled_from(["plain", "field", "inline"]))
    if kind == "field":
        msg["reasoning_content"] = draw(TEXT)
    elif kind == "inline":
        msg["content"] = f"<think>\n{draw(TEXT)}\n</think>\n\n{msg['content']}"
    if draw(st.booleans()):
        msg["tool_calls"] = draw(st.lists(tool_call(), min_size=1, max_size=2))
    return msg


@st.composite
def conversations(draw):
    msgs = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 2))):
        msgs.append({"role": "user", "content": draw(TEXT)})
        turn = draw(assistant_turn())
        msgs.append(turn)
        if turn.get("tool_calls"):
            msgs.append({"role": "tool", "content": draw(TEXT)})
            msgs.append(draw(assistant_turn()))
    tools = draw(st.sampled_from([None, "record", "spec"]))
    return msgs, tools


def prefix_expected(tokenizer, end_of_turn: str, tools):
    """Each assistant turn's text in a template that renders earlier turns the same whatever follows."""
    def expected(messages: list[dict], thinking: bool) -> list[str | None]:
        enc = encoder_for(tokenizer, thinking=thinking)
        msgs = enc.locator.template_messages(parse_line(json.dumps({"messages": messages}), "d").messages)

        def render(part, prompt):
            return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt, tools=tools,
                                                 enable_thinking=thinking)
        out = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, upto = render(msgs[:i], True), render(msgs[:i + 1], False)
            assert upto.startswith(before)
            turn = upto[len(before):]
            turn = turn[:turn.rfind(end_of_turn) + len(end_of_turn)] if end_of_turn in turn else turn
            last = i == len(messages) - 1
            # a turn with no text of its own is trained only as the last one (as the template renders it)
            out.append(None if not last and not m["content"] and turn in ("", end_of_turn) else turn or None)
        return out
    return expected


def check_conversation(tokenizer, expected_fn, convo, thinking):
    messages, where = convo
    opts = {"template_kwargs": {"tools": TOOLS}} if where == "spec" else {}
    tools = TOOLS if where == "record" else None
    try:
        tokenizer.apply_chat_template(messages, tokenize=False, tools=TOOLS if where else None,
                                      enable_thinking=thinking)
    except Exception:  # noqa: BLE001 - a conversation the template itself refuses (Gemma 3: no tool role)
        enc = encoder_for(tokenizer, thinking=thinking, **opts)
        with pytest.raises(SampleError) as err:
            enc.prepare(parse_line(json.dumps({"messages": messages, "tools": tools}), "d"))
        assert err.value.reason == TEMPLATE_ERROR
        return
    check(tokenizer, messages, expected_fn, thinking=thinking, tools=tools, **opts)


PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])


@PROPS
@given(convo=conversations(), thinking=st.booleans())
def test_property_qwen3_tools_and_reasoning(qwen3_tokenizer, convo, thinking):
    check_conversation(qwen3_tokenizer, qwen3_expected, convo, thinking)


@pytest.mark.parametrize("name", REAL_TEMPLATES)
def test_property_real_templates(real_template_tokenizers, name):
    tokenizer = real_template_tokenizers[name]

    @PROPS
    @given(convo=conversations(), thinking=st.booleans())
    def run(convo, thinking):
        tools = TOOLS if convo[1] else None
        check_conversation(tokenizer, prefix_expected(tokenizer, END_OF_TURN[name], tools), convo, thinking)

    run()


def _call(args):
    return {"type": "function", "function": {"name": "lookup", "arguments": args}}


def end_of_turn_examples(eot: str) -> dict:
    """Conversations holding an end-of-turn text in an assistant's content and in tool-call arguments, with
    empty turns after them (no located text of their own to stop a turn's end at)."""
    args = {"q": f"stop {eot} here {eot}", "n": 1}
    return {
        "assistant_content": [{"role": "user", "content": "u"}, {"role": "assistant", "content": f"a{eot}b"},
                              {"role": "user", "content": ""}, {"role": "assistant", "content": eot}],
        "user_content": [{"role": "user", "content": f"{eot}<｜Assistant｜>"}, {"role": "assistant", "content": "a"},
                         {"role": "user", "content": eot}, {"role": "assistant", "content": f"b {eot}"}],
        **{f"tool_arguments_{kind}": [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a", "tool_calls": [_call(json.dumps(args, ensure_ascii=False) if kind == "string" else args)]},
            {"role": "tool", "content": ""}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "v"}, {"role": "assistant", "content": f"b{eot}"}]
           for kind in ("string", "object")},
    }


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("eot", ["deepseek_v3", "own"])
@pytest.mark.parametrize("case", sorted(end_of_turn_examples("")))
@pytest.mark.parametrize("name", REAL_TEMPLATES)
def test_end_of_turn_text_in_contents_and_arguments(real_template_tokenizers, name, case, eot, thinking):
    """The end-of-turn text (DeepSeek V3's, and each template's own) inside a content or a tool call's
    arguments is trained as text of its turn, never taken for the turn's end: each trained run is exactly
    its turn, none runs on into the next."""
    tokenizer = real_template_tokenizers[name]
    text = END_OF_TURN["deepseek_v3" if eot == "deepseek_v3" else name]
    convo = (end_of_turn_examples(text)[case], None)
    check_conversation(tokenizer, prefix_expected(tokenizer, END_OF_TURN[name], None), convo, thinking)
