"""How many requests an OpenAI-compatible server can decode at once, for the ``openai`` engine's default concurrency.

A server decodes a batch of sequences for about the cost of one until it is compute-bound, but every request
in flight shares its rate: on a CPU (SmolLM2 on two cores, ~130 tokens/s in all) 256 answers of 512 tokens
would each take about 1,000 s, past the request timeout, and a measured run at 256 in flight was no faster
than 64 (README, "Performance"). So the default stays at most :data:`AUTO_MAX` and comes down to what the
server's KV cache holds, where a request beyond it would only be pre-empted and recomputed: vLLM publishes
its cache on ``/metrics`` (``vllm:cache_config_info``: ``num_gpu_blocks`` blocks of ``block_size`` tokens, on
the CPU build too), and the default is that many tokens over ``max_new_tokens`` (each sequence in flight may
grow to the budget), between 1 and :data:`AUTO_MAX`. A server that publishes no capacity gets
:data:`DEFAULT_CONCURRENCY`. A larger server (a GPU) is driven harder by setting ``concurrency``.
"""

from __future__ import annotations

import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 64
AUTO_MAX = 64
CACHE_INFO = "vllm:cache_config_info"


def kv_tokens(metrics_text: str) -> int | None:
    """Tokens of KV cache a vLLM ``/metrics`` page reports (blocks x block size); None when it reports none."""
    try:
        labels = next((sample.labels for family in text_string_to_metric_families(metrics_text)
                       for sample in family.samples if sample.name == CACHE_INFO), None)
    except ValueError as exc:  # not Prometheus text (up to the cache's sample)
        log.info("unreadable metrics page", extra={"error": str(exc)})
        return None
    if labels is None:
        return None
    try:
        blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        return None
    return blocks * block_size if blocks > 0 and block_size > 0 else None


def concurrency_for(tokens: int | None, max_new_tokens: int) -> int:
    """Requests to keep in flight for a server holding ``tokens`` of KV cache (see the module docstring)."""
    if tokens is None:
        return DEFAULT_CONCURRENCY
    return max(1, min(AUTO_MAX, tokens // max(1, max_new_tokens)))


async def server_kv_tokens(client: httpx.AsyncClient, base_url: str) -> int | None:
    """The KV capacity the server at ``base_url`` (``.../v1``) publishes on ``/metrics``; None if it publishes none."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        resp = await client.get(root + "/metrics")
    except httpx.HTTPError as exc:
        log.info("no server capacity", extra={"url": root + "/metrics", "error": f"{type(exc).__name__}: {exc}"})
        return None
    return kv_tokens(resp.text) if resp.status_code == 200 else None
