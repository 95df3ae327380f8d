"""How many requests an OpenAI-compatible server can decode at once, for the ``openai`` engine's default concurrency.

A CPU or GPU decodes a batch of sequences for about the cost of one until it is compute-bound, so a server
kept short of requests runs far below the machine's rate; requests beyond what it holds only wait in its
queue (and near the request timeout). vLLM publishes its KV cache on ``/metrics``
(``vllm:cache_config_info``: ``num_gpu_blocks`` blocks of ``block_size`` tokens, on the CPU build too): the
default concurrency is that many tokens over ``max_new_tokens`` (each sequence in flight may grow to the
budget; most end sooner, and the server pre-empts rather than fails when it runs short), between 1 and
:data:`AUTO_MAX` (vLLM's default ``max_num_seqs``, the most it schedules at once). A server that publishes
no capacity gets :data:`DEFAULT_CONCURRENCY`.
"""

from __future__ import annotations

import logging
import re

import httpx

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 64
AUTO_MAX = 256
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_tokens(metrics_text: str) -> int | None:
    """Tokens of KV cache a vLLM ``/metrics`` page reports (blocks x block size); None when it reports none."""
    match = _CACHE_INFO.search(metrics_text)
    if not match:
        return None
    labels = dict(_LABEL.findall(match.group(1)))
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
