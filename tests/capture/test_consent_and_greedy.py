"""What a record may say and hold, tried through a real pass-through: an opt-out wins wherever it appears,
redaction reaches every scalar, and ``greedy`` is claimed only for the target's own greedy answer."""

from __future__ import annotations

import json

import httpx
import pytest
from dfp_capture.assemble import CHAT as CHAT_KIND
from dfp_capture.assemble import COMPLETIONS, admit, not_greedy_reasons
from dfp_capture.proxy import wants_capture
from dfp_capture.settings import CaptureSettings
from dfp_capture.writer import Redactor
from starlette.datastructures import Headers

from .conftest import wait_records, written_files

CHAT = {"model": "tiny-target", "messages": [{"role": "user", "content": "hello there"}], "temperature": 0}


def post(url: str, body: dict, headers) -> int:
    with httpx.Client(timeout=10) as client:
        return client.post(url + "/v1/chat/completions", json=body, headers=headers).status_code


def control_then_records(proxy, tmp_path) -> list[dict]:
    """One opted-in request after the others, then every record once the control's is written."""
    post(proxy.url, {**CHAT, "messages": [{"role": "user", "content": "control"}]}, [("X-DFlash-Capture", "1")])
    found = wait_records(tmp_path / "capture", 1)
    assert any(r["messages"][0]["content"] == "control" for r in found), "the control request was not recorded"
    return found


OPT_OUTS = [
    [("X-DFlash-Capture", "1"), ("X-DFlash-Capture", "0")],
    [("X-DFlash-Capture", "0"), ("X-DFlash-Capture", "1")],
    [("X-DFlash-Capture", "0, 1")],
    [("X-DFlash-Capture", "1, 0")],
    [("X-DFlash-Capture", "1,no")],
    [("x-dflash-capture", "yes"), ("X-DFLASH-CAPTURE", "OFF")],
    [("X-DFlash-Capture", '"0"')],
    [("X-DFlash-Capture", "never")],
]


def test_an_opt_out_anywhere_in_the_header_wins(upstream, capture, tmp_path):
    proxy = capture(capture_enabled=True)
    for i, header in enumerate(OPT_OUTS):
        assert post(proxy.url, {**CHAT, "messages": [{"role": "user", "content": f"opted out {i}"}]}, header) == 200
    found = control_then_records(proxy, tmp_path)
    assert [r["messages"][0]["content"] for r in found] == ["control"]
    assert not any(b"opted out" in p.read_bytes() for p in written_files(tmp_path / "capture"))


def test_the_header_read_as_a_whole_list():
    off = CaptureSettings(storage_url="file:///tmp/x", capture_upstream="http://127.0.0.1:1")
    on = CaptureSettings(storage_url="file:///tmp/x", capture_upstream="http://127.0.0.1:1", capture_enabled=True)
    both = Headers(raw=[(b"x-dflash-capture", b"1"), (b"x-dflash-capture", b"1")])
    assert wants_capture(off, both) and wants_capture(on, both)
    for word in (b"maybe", b'"0"', b"0;x", b"disable", b"never", b"1, maybe"):  # any word not an opt-in opts out
        assert not wants_capture(on, Headers(raw=[(b"x-dflash-capture", word)])), word
    assert wants_capture(on, Headers(raw=[(b"x-dflash-capture", b"")]))  # an empty value says nothing


CARD = 4111111111111111


def test_redaction_reaches_numbers_and_every_other_scalar(upstream, capture, tmp_path):
    proxy = capture(capture_enabled=True, capture_redact=json.dumps([r"\b\d{13,16}\b"]))
    body = {**CHAT, "seed": CARD, "chat_template_kwargs": {"account": CARD, "flag": True},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "my card"},
                                                      {"type": "card", "number": CARD, "float": float(CARD)}]}]}
    assert post(proxy.url, body, None) == 200
    [record] = wait_records(tmp_path / "capture", 1)
    data = b"".join(p.read_bytes() for p in written_files(tmp_path / "capture"))
    assert str(CARD).encode() not in data
    assert record["meta"]["sampling"]["seed"] == "[REDACTED]" and record["meta"]["not_greedy"] == ["chat_template_kwargs"]
    assert record["meta"]["sampling"]["chat_template_kwargs"] == {"account": "[REDACTED]", "flag": True}
    assert record["messages"][0]["content"][1] == {"type": "card", "number": "[REDACTED]", "float": "[REDACTED].0"}


def test_redaction_keeps_scalars_no_pattern_matches():
    redact = Redactor([r"\d{6,}"])
    value = {"a": 12, "b": 1.5, "c": None, "d": False, "e": [123456789, "x 1234567 y"], "1234567": 3}
    assert redact(value) == {"a": 12, "b": 1.5, "c": None, "d": False, "e": ["[REDACTED]", "x [REDACTED] y"],
                             "[REDACTED]": 3}


NOT_GREEDY = [
    ({"logit_bias": {"42": 100}}, "logit_bias"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"min_tokens": 16}, "min_tokens"),
    ({"bad_words": ["no"]}, "bad_words"),
    ({"ignore_eos": True}, "ignore_eos"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"a_field_of_tomorrow": 1}, "a_field_of_tomorrow"),
    ({"temperature": 0.7}, "sampled"),
    ({"temperature": None}, "sampled"),
    ({"chat_template_kwargs": {"tools": [{"type": "function"}]}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
]


def test_greedy_only_for_the_targets_own_greedy_answer(upstream, capture, tmp_path):
    proxy = capture(capture_enabled=True)
    for i, (extra, _) in enumerate(NOT_GREEDY):
        body = {k: v for k, v in {**CHAT, **extra}.items() if v is not None}
        assert post(proxy.url, {**body, "messages": [{"role": "user", "content": f"case {i}"}]}, None) == 200
    found = {r["messages"][0]["content"]: r["meta"] for r in wait_records(tmp_path / "capture", len(NOT_GREEDY))}
    for i, (extra, reason) in enumerate(NOT_GREEDY):
        meta = found[f"case {i}"]
        assert meta["greedy"] is False and reason in meta["not_greedy"], (extra, meta)


NEUTRAL = [{}, {"top_k": 1, "temperature": 0.8}, {"logit_bias": {}}, {"response_format": {"type": "text"}},
           {"tools": [], "tool_choice": "none"}, {"presence_penalty": 0, "repetition_penalty": 1},
           {"stream": True, "stream_options": {"include_usage": True}}, {"seed": 3, "stop": ["\n"], "n": 1},
           {"chat_template_kwargs": {}, "max_completion_tokens": 9, "user": "u"}]


@pytest.mark.parametrize("extra", NEUTRAL)
def test_requests_that_leave_greedy_decoding_alone_stay_greedy(extra):
    body = {**CHAT, **extra}
    assert not_greedy_reasons(body) == []
    exchange = admit(CHAT_KIND, json.dumps(body).encode(), 64, 4, 2**20)
    assert exchange.not_greedy == []


def test_a_message_field_the_record_drops_makes_it_not_greedy():
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
                                 {"role": "tool", "content": "4", "tool_call_id": "1"}]}
    assert admit(CHAT_KIND, json.dumps(body).encode(), 64, 4, 2**20).not_greedy == ["message_fields"]
    completion = {"prompt": "def f(", "temperature": 0, "suffix": "return 1", "echo": False}
    assert admit(COMPLETIONS, json.dumps(completion).encode(), 64, 4, 2**20).not_greedy == ["suffix"]
