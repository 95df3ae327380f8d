"""Both engines for real: a tiny random Qwen3 in-process, and a loopback OpenAI-compatible server."""

from __future__ import annotations

import json

import pytest
from dfp_generation.engines import GenRequest, SamplingParams
from dfp_generation.engines.openai_engine import OpenAIEngine
from dfp_generation.engines.transformers_engine import TransformersEngine
from dfp_generation.plan import plan_shards
from dfp_generation.shard import ShardRunner
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_shared.specs.generate import GenerateSpec
from dfp_shared.specs.tokenize import TokenizeSpec

from .conftest import read_jsonl, write_jsonl
from .openai_server import LoopbackOpenAI

PROMPTS = [
    {"id": "math", "messages": [{"role": "system", "content": "You are terse."},
                                {"role": "user", "content": "What is 2+2?"}]},
    {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "old answer"}]},
    "{this line is broken",
    {"prompt": "Write one word."},
    {"prompt": "And a much longer prompt so that the batch needs left padding to line the rows up. " * 3},
]


@pytest.fixture(scope="module")
def tiny_engine(tiny_qwen3_dir):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from threads and loses a lot on a busy machine
    engine = TransformersEngine(str(tiny_qwen3_dir), device="cpu", batch_size=4)
    yield engine
    engine.close()
    torch.set_num_threads(threads)


def tokenizer_accepts(model_dir, completions_file, expected: int, thinking: bool = True) -> dict:
    """Feed a completion shard to the tokenizer service's own file tokenizer, unchanged."""
    from dfp_tokenizer.encoder import SampleEncoder
    from dfp_tokenizer.files import tokenize_file

    spec = TokenizeSpec(input=str(completions_file), output="/unused", tokenizer=str(model_dir), thinking=thinking)
    encoder = SampleEncoder(load_tokenizer(model_dir), spec)
    result = tokenize_file(completions_file.read_bytes(), str(completions_file), "shards/x.safetensors", encoder,
                           id_prefix="x")
    assert result.errors == [], result.errors
    assert result.stats.samples == expected
    return result


def check_record(rec: dict, spec: GenerateSpec) -> None:
    assert set(rec) == {"id", "messages", "meta"}
    assert isinstance(rec["id"], str) and rec["id"]
    *prompt, answer = rec["messages"]
    assert prompt and all(m["role"] in ("system", "user", "assistant", "tool") for m in prompt)
    assert answer["role"] == "assistant" and isinstance(answer["content"], str)
    assert answer.get("reasoning_content") is None or isinstance(answer["reasoning_content"], str)
    meta = rec["meta"]
    assert meta["finish_reason"] in ("stop", "length")
    assert meta["truncated"] == (meta["finish_reason"] == "length")
    assert 0 < meta["completion_tokens"] <= spec.max_new_tokens and meta["prompt_tokens"] > 0
    assert meta["sampling"] == {"temperature": spec.temperature, "top_p": spec.top_p,
                                "max_new_tokens": spec.max_new_tokens, "seed": meta["sampling"]["seed"],
                                "thinking": spec.thinking}


@pytest.mark.parametrize("thinking, temperature", [(True, 0.0), (False, 0.8)])
def test_transformers_records_are_well_formed_and_tokenizable(tmp_path, tiny_qwen3_dir, tiny_engine, thinking,
                                                              temperature):
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    spec = GenerateSpec(prompts=str(tmp_path / "prompts.jsonl"), output=str(tmp_path / "out"),
                        model=str(tiny_qwen3_dir), max_new_tokens=12, temperature=temperature, thinking=thinking,
                        shard_size=10)
    plan = plan_shards(spec.prompts, spec.shard_size)
    outcome = ShardRunner(spec, tiny_engine).run(plan.source.root, plan.shards[0])
    assert (outcome.prompts, outcome.completions, outcome.errors, outcome.unreadable) == (4, 4, 0, 1)
    records = read_jsonl(tmp_path / "out" / "completions" / "shard-00000.jsonl")
    assert [r["id"] for r in records] == ["math", "prompts.jsonl:2", "prompts.jsonl:4", "prompts.jsonl:5"]
    for rec in records:
        check_record(rec, spec)
        assert rec["meta"]["engine"] == "transformers"
    # the prompt's own turns are kept, the stale assistant answer of the ShareGPT row is not
    assert records[0]["messages"][:2] == PROMPTS[0]["messages"]
    assert records[1]["messages"][0] == {"role": "user", "content": "Name a colour."}
    assert records[3]["meta"]["prompt_tokens"] > records[2]["meta"]["prompt_tokens"]
    errors = read_jsonl(tmp_path / "out" / "errors" / "shard-00000.jsonl")
    assert errors == [{"file": f"file://{tmp_path}/prompts.jsonl", "line": 3, "kind": "unreadable_prompt",
                       "error": errors[0]["error"]}] and "invalid JSON" in errors[0]["error"]
    tokenizer_accepts(tiny_qwen3_dir, tmp_path / "out" / "completions" / "shard-00000.jsonl", 4, thinking)


def test_transformers_greedy_is_deterministic_and_batching_does_not_change_it(tiny_engine):
    reqs = [GenRequest(str(i), [{"role": "user", "content": "word " * (i * 7 + 1)}], i) for i in range(2)]
    params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=4, thinking=True)
    batched = {r.id: r for r in tiny_engine.generate(reqs, params)}
    alone = {r.id: r for req in reqs for r in tiny_engine.generate([req], params)}
    for rid in batched:
        assert batched[rid].ok
        assert (batched[rid].content, batched[rid].reasoning) == (alone[rid].content, alone[rid].reasoning)


def test_transformers_too_long_prompt_fails_alone(tiny_engine):
    reqs = [GenRequest("long", [{"role": "user", "content": "word " * (tiny_engine.max_positions + 10)}], 1),
            GenRequest("short", [{"role": "user", "content": "hi"}], 2)]
    got = {r.id: r for r in tiny_engine.generate(reqs, SamplingParams(0.0, 1.0, 3, True))}
    assert not got["long"].ok and got["long"].error.startswith("prompt too long:")
    assert got["short"].ok and got["short"].completion_tokens > 0


def test_openai_retries_faults_and_reports_failures(tmp_path, tiny_qwen3_dir):
    server = LoopbackOpenAI(latency=0.01, stall_s=1.5, reasoning="inline").start()
    try:
        rows = [{"id": f"p{i}", "prompt": f"question {i}" + marker} for i, marker in enumerate(
            ["", "[[429x2]]", "[[500x1]]", "[[timeoutx1]]", "[[always500]]", "[[400]]", "[[length]]", "",
             "[[429x1]][[500x1]]", ""])]
        write_jsonl(tmp_path / "p.jsonl", rows)
        spec = GenerateSpec(prompts=str(tmp_path / "p.jsonl"), output=str(tmp_path / "out"), engine="openai",
                            openai_model="target", concurrency=4,
                            request_timeout_s=0.5, max_retries=3, samples_per_prompt=2, max_new_tokens=64)
        engine = OpenAIEngine(server.base_url, "target", concurrency=4, timeout_s=0.5, max_retries=3,
                              backoff_base_s=0.01, backoff_max_s=0.05)
        request, in_flight = engine._request, {"now": 0, "max": 0}

        async def counted(*args):  # requests in flight as the client sees them
            in_flight["now"] += 1
            in_flight["max"] = max(in_flight["max"], in_flight["now"])
            try:
                return await request(*args)
            finally:
                in_flight["now"] -= 1

        engine._request = counted
        plan = plan_shards(spec.prompts, 100)
        outcome = ShardRunner(spec, engine).run(plan.source.root, plan.shards[0])
        engine.close()
    finally:
        server.stop()
    records = read_jsonl(tmp_path / "out" / "completions" / "shard-00000.jsonl")
    errors = read_jsonl(tmp_path / "out" / "errors" / "shard-00000.jsonl")
    out_ids = [r["id"] for r in records]
    err_ids = [e["id"] for e in errors]
    expected = {f"p{i}#{k}" for i in range(10) for k in range(2)}
    assert len(out_ids) == len(set(out_ids)) and len(err_ids) == len(set(err_ids))
    assert set(out_ids) | set(err_ids) == expected and not set(out_ids) & set(err_ids)
    assert set(err_ids) == {"p4#0", "p4#1", "p5#0", "p5#1"}
    by_id = {e["id"]: e for e in errors}
    assert "failed after 4 attempts" in by_id["p4#0"]["error"] and "HTTP 500" in by_id["p4#0"]["error"]
    assert by_id["p5#0"]["error"].startswith("HTTP 400") and by_id["p5#0"]["attempts"] == 1
    assert (outcome.completions, outcome.errors) == (16, 4)
    assert in_flight["max"] == 4
    assert server.status_counts[429] == 2 * 2 + 2 and server.status_counts[400] == 2
    recs = {r["id"]: r for r in records}
    assert recs["p6#0"]["meta"]["finish_reason"] == "length" and recs["p6#0"]["meta"]["truncated"]
    assert recs["p0#0"]["messages"][-1] == {"role": "assistant", "content": "answer to: question 0",
                                            "reasoning_content": "thinking about: question 0"}
    assert recs["p0#0"]["meta"]["sampling"]["seed"] != recs["p0#1"]["meta"]["sampling"]["seed"]
    for rec in records:
        check_record(rec, spec)
    body = server.bodies[0]
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["max_tokens"] == 64
    tokenizer_accepts(tiny_qwen3_dir, tmp_path / "out" / "completions" / "shard-00000.jsonl", 16)


def test_openai_reasoning_field_and_thinking_off(openai_server):
    engine = OpenAIEngine(openai_server.base_url, "m", concurrency=2)
    reqs = [GenRequest("a", [{"role": "user", "content": "hi"}], 1)]
    on = engine.generate(reqs, SamplingParams(0.6, 0.95, 32, thinking=True))[0]
    off = engine.generate(reqs, SamplingParams(0.6, 0.95, 32, thinking=False))[0]
    engine.close()
    assert (on.reasoning, on.content) == ("thinking about: hi", "answer to: hi")
    assert (off.reasoning, off.content) == (None, "answer to: hi")
    assert json.loads(json.dumps(openai_server.bodies[-1]))["chat_template_kwargs"] == {"enable_thinking": False}


def test_openai_connection_refused_is_an_error_not_a_crash():
    from tests.support.servers import free_port

    engine = OpenAIEngine(f"http://127.0.0.1:{free_port()}/v1", "m", max_retries=1, backoff_base_s=0.01)
    res = engine.generate([GenRequest("a", [{"role": "user", "content": "hi"}], 1)], SamplingParams(0, 1, 8, True))
    engine.close()
    assert not res[0].ok and "connection error" in res[0].error and res[0].attempts == 2


def test_openai_retry_pauses_attempts_and_retry_after(monkeypatch):
    """Pauses double from the base up to the cap (jitter of half to the whole of it); a Retry-After answer
    waits what it asks, up to 300 s, past the cap; each retry is counted by its reason; the last failure
    names itself and the attempts; a 4xx other than 429 fails at once."""
    import asyncio
    import random

    import httpx
    from prometheus_client import REGISTRY

    slept: list[float] = []

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    monkeypatch.setattr(random, "random", lambda: 0.5)  # jitter factor 0.75
    engine = OpenAIEngine("http://openai.test/v1", "m", max_retries=5, backoff_base_s=1.0, backoff_max_s=3.0)
    answer = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1}}

    def run(*script):
        calls: list[httpx.Request] = []
        slept.clear()

        def handler(request: httpx.Request) -> httpx.Response:
            calls.append(request)
            step = script[len(calls) - 1] if len(calls) <= len(script) else 200
            if isinstance(step, Exception):
                raise step
            status, headers = step if isinstance(step, tuple) else (step, {})
            if status == 200:
                return httpx.Response(200, json=answer)
            return httpx.Response(status, headers=headers, text=f"injected\n{status}")

        async def request():
            async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
                return await engine._request(client, GenRequest("a", [{"role": "user", "content": "hi"}], 1),
                                             SamplingParams(0.0, 1.0, 8, True))
        return asyncio.run(request()), len(calls)

    def retries(reason: str) -> float:
        return REGISTRY.get_sample_value("dfp_generation_http_retries_total", {"reason": reason}) or 0.0

    before = {r: retries(r) for r in ("500", "429", "503", "timeout", "connection")}
    result, calls = run(500, (429, {"Retry-After": "1000"}), (503, {"Retry-After": "2"}),
                        httpx.ReadTimeout("slow"), httpx.ConnectError("refused"))
    assert result.ok and result.content == "hi" and result.attempts == 6 and calls == 6
    assert slept == [0.75, 300.0, 2.0, 2.25, 2.25]
    assert {r: retries(r) - n for r, n in before.items()} == dict.fromkeys(before, 1.0)

    result, calls = run(500, 502, (503, {"Retry-After": "7"}), 500, 500, 500, 200)
    assert not result.ok and result.attempts == 6 and calls == 6
    assert result.error == "failed after 6 attempts; last: HTTP 500: injected 500"
    assert slept == [0.75, 1.5, 7.0, 2.25, 2.25]

    result, calls = run(429, 400)
    assert (result.error, result.attempts, calls, slept) == ("HTTP 400: injected 400", 2, 2, [0.75])
    result, calls = run(httpx.ConnectError("refused"), (200, {}))
    assert result.ok and result.attempts == 2

    engine = OpenAIEngine("http://openai.test/v1", "m", max_retries=0)
    result, calls = run(httpx.ConnectTimeout("slow"))
    assert (result.error, result.attempts, calls, slept) == (
        "failed after 1 attempts; last: timeout: ConnectTimeout", 1, 1, [])


def test_transformers_hybrid_target_batches_like_single_requests(tiny_hybrid_dir):
    """A Qwen3.5-style hybrid (linear + full attention) target: left-padded batches match lone requests."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = TransformersEngine(str(tiny_hybrid_dir), device="cpu", batch_size=4)
        reqs = [GenRequest(str(i), [{"role": "user", "content": "hello there " * (i * 5 + 1)}], i) for i in range(3)]
        params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=5, thinking=True)
        batched = {r.id: r for r in engine.generate(reqs, params)}
        alone = {r.id: r for req in reqs for r in engine.generate([req], params)}
    finally:
        torch.set_num_threads(threads)
    assert [batched[str(i)].prompt_tokens for i in range(3)] == sorted(b.prompt_tokens for b in batched.values())
    for rid, res in batched.items():
        assert res.ok and res.completion_tokens > 0
        assert res.content == alone[rid].content
