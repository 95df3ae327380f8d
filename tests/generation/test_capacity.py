"""The openai engine's default concurrency comes from the server's published KV capacity."""

from __future__ import annotations

from dfp_generation.engines import GenRequest, SamplingParams
from dfp_generation.engines.capacity import AUTO_MAX, DEFAULT_CONCURRENCY, concurrency_for, kv_tokens
from dfp_generation.engines.openai_engine import OpenAIEngine

from tests.generation.openai_server import LoopbackOpenAI

VLLM_METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_cpu_blocks="None",\
num_gpu_blocks="1456",swap_space="0"} 1.0
vllm:num_requests_running{model_name="m"} 0.0
"""


def test_kv_tokens_of_a_vllm_metrics_page_and_the_concurrency_they_allow():
    assert kv_tokens(VLLM_METRICS) == 1456 * 16
    assert kv_tokens("vllm:num_requests_running 0.0\n") is None
    assert kv_tokens('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0') is None
    assert concurrency_for(1456 * 16, 512) == 45  # the cache holds 45 answers of 512 tokens
    assert concurrency_for(1 << 30, 64) == AUTO_MAX and concurrency_for(100, 512) == 1
    assert concurrency_for(None, 256) == DEFAULT_CONCURRENCY


def test_kv_tokens_reads_samples_with_timestamps_and_escaped_label_values():
    page = ('vllm:num_requests_running{model_name="a\\"b"} 3 1700000000000\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="a\\"}b",num_gpu_blocks="1456"} 1.0 1700000000000\n')
    assert kv_tokens(page) == 1456 * 16  # the brace inside a quoted label value does not end the labels
    assert kv_tokens("<html><body>not found</body></html>") is None


def _run(server: LoopbackOpenAI, n: int, max_new_tokens: int, concurrency: int | None = None) -> int:
    engine = OpenAIEngine(server.base_url, "m", concurrency=concurrency, timeout_s=30, max_retries=0)
    try:
        reqs = [GenRequest(f"p{i}", [{"role": "user", "content": f"q {i}"}], i) for i in range(n)]
        results = engine.generate(reqs, SamplingParams(0.0, 1.0, max_new_tokens, thinking=False))
        assert sorted(r.id for r in results) == sorted(q.id for q in reqs) and not any(r.error for r in results)
        return server.max_in_flight
    finally:
        engine.close()


def test_unset_concurrency_is_what_the_server_s_cache_holds():
    server = LoopbackOpenAI(latency=0.2, kv_tokens=48 * 64).start()  # room for 48 sequences of 64 new tokens
    try:
        assert _run(server, 120, 64) == 48
    finally:
        server.stop()


def test_a_server_without_capacity_gets_the_default_and_a_set_concurrency_is_kept():
    server = LoopbackOpenAI(latency=0.2).start()
    try:
        assert _run(server, DEFAULT_CONCURRENCY + 8, 64) == DEFAULT_CONCURRENCY
    finally:
        server.stop()
    server = LoopbackOpenAI(latency=0.2, kv_tokens=1 << 20).start()
    try:
        assert _run(server, 20, 64, concurrency=5) == 5
    finally:
        server.stop()
