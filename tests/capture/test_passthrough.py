"""The pass-through in front of a real (fake) upstream on loopback: bytes unchanged, exchanges recorded."""

from __future__ import annotations

import httpx
import pytest

from .conftest import counter, records, wait_records

CHAT = {"model": "tiny-target", "messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hello there"}],
        "temperature": 0, "max_tokens": 64, "chat_template_kwargs": {"enable_thinking": True}}
OPT_IN = {"X-DFlash-Capture": "1"}


def raw(url: str, path: str, body: dict | None = None, headers=None) -> tuple[int, str, bytes]:
    with httpx.Client(timeout=10) as client:
        method = "POST" if body is not None else "GET"
        with client.stream(method, url + path, json=body, headers=headers) as reply:
            return reply.status_code, reply.headers.get("content-type"), b"".join(reply.iter_raw())


def test_a_stream_passes_through_byte_for_byte_and_is_recorded_whole(upstream, capture, tmp_path):
    proxy = capture()
    body = {**CHAT, "stream": True}
    direct = raw(upstream.url, "/v1/chat/completions", body)
    through = raw(proxy.url, "/v1/chat/completions", body, OPT_IN)
    assert through == direct and direct[1].startswith("text/event-stream") and b"data: [DONE]" in direct[2]
    assert "x-dflash-capture" not in upstream.app.state.seen_headers[-1]

    [record] = wait_records(tmp_path / "capture", 1)
    assert record["messages"][:2] == CHAT["messages"]
    answer = record["messages"][2]
    assert answer == {"role": "assistant", "content": "echo: hello there ",
                      "reasoning_content": "thinking about hello there "}
    meta = record["meta"]
    assert meta["finish_reason"] == "stop" and meta["incomplete"] is False and meta["source"] == "capture"
    # the template's own arguments changed the prompt the target saw: not its greedy answer to these messages
    assert meta["greedy"] is False and meta["not_greedy"] == ["chat_template_kwargs"]
    assert meta["model"] == "tiny-target" and meta["endpoint"] == "chat"
    assert meta["sampling"] == {"temperature": 0, "max_tokens": 64, "chat_template_kwargs": {"enable_thinking": True}}
    assert meta["captured_at"].endswith("Z")
    [shard] = list((tmp_path / "capture" / "completions").glob("*/test-*.jsonl"))
    assert len(shard.parent.name) == len("20260101T00")


def test_whole_replies_pass_through_and_are_recorded(upstream, capture, tmp_path):
    proxy = capture(capture_enabled=True)
    completion = {"model": "tiny-target", "prompt": "once upon a time", "max_tokens": 8, "temperature": 0.7}
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", completion),
                       ("/v1/completions", {**completion, "stream": True})):
        assert raw(proxy.url, path, body) == raw(upstream.url, path, body)
    found = sorted(wait_records(tmp_path / "capture", 3), key=lambda r: (r["meta"]["endpoint"], r["meta"]["finish_reason"]))
    chat, whole, streamed = found
    assert chat["messages"][-1]["content"] == "echo: hello there" and chat["meta"]["finish_reason"] == "stop"
    assert whole["messages"] == [{"role": "user", "content": "once upon a time"},
                                 {"role": "assistant", "content": "once upon a time and so on"}]
    assert whole["meta"]["finish_reason"] == "length" and whole["meta"]["greedy"] is False
    assert streamed["messages"][-1]["content"] == "once upon a time and so on "


def test_models_and_health_are_forwarded_and_probes_answer(upstream, capture):
    proxy = capture()
    for path in ("/v1/models", "/health"):
        assert raw(proxy.url, path) == raw(upstream.url, path)
    assert raw(proxy.url, "/healthz")[0] == 200 and raw(proxy.url, "/readyz")[0] == 200
    status, content_type, text = raw(proxy.url, "/metrics")
    assert status == 200 and b"dfp_capture_requests_total" in text


def test_a_client_that_leaves_mid_stream_leaves_a_record_marked_incomplete(capture, tmp_path):
    proxy = capture()
    body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "tell me [[slow]]"}]}
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", proxy.url + "/v1/chat/completions", json=body, headers=OPT_IN) as reply:
            seen = b""
            for chunk in reply.iter_raw():
                seen += chunk
                if b'"w3 "' in seen:
                    break
    [record] = wait_records(tmp_path / "capture", 1)
    assert record["meta"]["incomplete"] is True and record["meta"]["finish_reason"] is None
    assert record["messages"][-1]["content"].startswith("echo: tell me [[slow]] w0 w1 w2 w3")
    assert "w199" not in record["messages"][-1]["content"]


def test_secrets_are_redacted_before_anything_is_written(capture, tmp_path):
    proxy = capture(capture_redact=r'["sk-[A-Za-z0-9]{8,}", "(?i)password:\\s*\\S+"]')
    secret = "sk-ABCDEF123456789"
    body = {**CHAT, "messages": [{"role": "user", "content": f"my key is {secret} and password: hunter2"}]}
    for stream in (False, True):
        raw(proxy.url, "/v1/chat/completions", {**body, "stream": stream}, OPT_IN)
    found = wait_records(tmp_path / "capture", 2)
    assert len(found) == 2
    for record in found:
        assert record["messages"][0]["content"] == "my key is [REDACTED] and [REDACTED]"
        assert "[REDACTED]" in record["messages"][-1]["content"]
    for path in (tmp_path / "capture").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes() and b"hunter2" not in path.read_bytes()


def test_traffic_that_does_not_opt_in_or_opts_out_is_never_written(capture, tmp_path):
    quiet = capture()
    loud = capture(capture_enabled=True, capture_prefix=f"file://{tmp_path}/capture")
    for url, headers in ((quiet.url, None), (quiet.url, {"X-DFlash-Capture": "0"}), (loud.url, {"X-DFlash-Capture": "0"})):
        for stream in (False, True):
            raw(url, "/v1/chat/completions", {**CHAT, "stream": stream}, headers)
    marker = {**CHAT, "messages": [{"role": "user", "content": "the only one"}]}
    raw(quiet.url, "/v1/chat/completions", marker, OPT_IN)
    raw(loud.url, "/v1/chat/completions", marker)
    found = wait_records(tmp_path / "capture", 2)
    assert len(found) == 2 and all(r["messages"][0]["content"] == "the only one" for r in found)


def test_a_malformed_reply_is_passed_through_and_not_recorded(upstream, capture, tmp_path):
    proxy = capture(capture_enabled=True)
    before = counter("dfp_capture_dropped_total", reason="malformed_reply")
    bad = {**CHAT, "messages": [{"role": "user", "content": "[[malformed]]"}]}
    for stream in (False, True):
        body = {**bad, "stream": stream}
        assert raw(proxy.url, "/v1/chat/completions", body) == raw(upstream.url, "/v1/chat/completions", body)
    errored = {**CHAT, "messages": [{"role": "user", "content": "[[500]]"}]}
    assert raw(proxy.url, "/v1/chat/completions", errored)[0] == 500
    raw(proxy.url, "/v1/chat/completions", CHAT)
    found = wait_records(tmp_path / "capture", 1)
    assert [r["messages"][-2]["content"] for r in found] == ["hello there"]
    assert counter("dfp_capture_dropped_total", reason="malformed_reply") - before == 2
    assert records(tmp_path / "capture") == found


def test_oversized_requests_are_refused_or_not_captured(capture, tmp_path):
    proxy = capture(capture_enabled=True, capture_max_body_bytes=4096, capture_max_messages=4)
    assert raw(proxy.url, "/v1/chat/completions", {**CHAT, "pad": "x" * 5000})[0] == 413
    many = {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 5}
    assert raw(proxy.url, "/v1/chat/completions", many)[0] == 200
    raw(proxy.url, "/v1/chat/completions", CHAT)
    found = wait_records(tmp_path / "capture", 1)
    assert len(found) == 1 and len(found[0]["messages"]) == 3


def test_a_stream_the_upstream_breaks_off_is_cut_for_the_client_and_not_recorded(capture, tmp_path):
    proxy = capture(capture_enabled=True)
    cut = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "[[cut]]"}]}
    with pytest.raises(httpx.HTTPError):
        raw(proxy.url, "/v1/chat/completions", cut)
    raw(proxy.url, "/v1/chat/completions", CHAT)
    found = wait_records(tmp_path / "capture", 1)
    assert [r["messages"][-2]["content"] for r in found] == ["hello there"]
    assert records(tmp_path / "capture") == found
