"""The ``openai`` engine: any OpenAI-compatible chat completions server (vLLM, SGLang, ...).

Requests run on an asyncio loop with at most ``concurrency`` in flight: that many slots, each
with its own keep-alive connection, take the next request when the last one is done. Unset, the
concurrency is sized once from the server's KV capacity (:mod:`.capacity`). 429, 5xx, timeouts and connection errors are retried with
exponential backoff and jitter, honouring ``Retry-After``; other 4xx answers fail the request at
once. The reasoning is read from the response message's ``reasoning_content`` (or
``reasoning``), else split from ``<think>`` tags in the content. Thinking mode is passed as
``chat_template_kwargs.enable_thinking``, which vLLM and SGLang forward to the chat template.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import threading
import time
from collections import deque
from typing import NamedTuple

import httpx
from dfp_shared.records.thinking import split_thinking
from prometheus_client import Counter
from tenacity import AsyncRetrying, RetryCallState, retry_if_result, stop_after_attempt

from .base import Engine, GenRequest, GenResult, ResultCallback, SamplingParams, StopCheck
from .capacity import concurrency_for, server_kv_tokens

log = logging.getLogger(__name__)

ONE_CONNECTION = httpx.Limits(max_connections=1, max_keepalive_connections=1)
RETRIES = Counter("dfp_generation_http_retries_total", "Retried OpenAI-API requests", ["reason"])


class _Retry(NamedTuple):
    """An attempt worth repeating: its error, the reason it is counted by, and the Retry-After it asked for."""

    error: str
    reason: str
    retry_after: float | None = None


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(self, base_url: str, model: str, *, concurrency: int | None = None, timeout_s: float = 600.0,
                 max_retries: int = 6, api_key: str | None = None, backoff_base_s: float = 0.5,
                 backoff_max_s: float = 30.0, extra_body: dict | None = None):
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.model_name = model
        self.concurrency = concurrency  # None: from the server's capacity, per max_new_tokens (:mod:`.capacity`)
        self._server_tokens: tuple[int | None] | None = None  # the server's KV tokens, once asked
        self.timeout = httpx.Timeout(timeout_s, connect=min(30.0, timeout_s))
        self.max_retries = max_retries
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.extra_body = extra_body or {}
        self._ssl = None  # one TLS context for every slot (loading the CA bundle is slow)
        self._clients: list[httpx.AsyncClient] = []  # one per slot, kept open across generate() calls
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The engine's event loop, on its own thread, so connections stay open from shard to shard."""
        if self._loop is None:
            factory = _uvloop_factory() or asyncio.new_event_loop
            self._loop = factory()
            self._thread = threading.Thread(target=self._loop.run_forever, name="openai-engine", daemon=True)
            self._thread.start()
        return self._loop

    def generate(self, requests: list[GenRequest], params: SamplingParams, *, on_result: ResultCallback | None = None,
                 should_stop: StopCheck | None = None) -> list[GenResult]:
        """Runs on the engine's loop thread; ``on_result`` and ``should_stop`` are called from it."""
        coro = self.agenerate(requests, params, on_result=on_result, should_stop=should_stop)
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop()).result()

    def close(self) -> None:
        if self._loop is None:
            return

        async def close_clients() -> None:
            await asyncio.gather(*(c.aclose() for c in self._clients), return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close_clients(), self._loop).result(30)
        self._clients.clear()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()
        self._loop = self._thread = None

    def _client(self, index: int) -> httpx.AsyncClient:
        # one keep-alive connection per slot: a shared pool scans all its connections for every
        # request, which costs more CPU than the request itself at high concurrency
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        while len(self._clients) <= index:
            # no redirects: the bearer token goes to the configured endpoint and nowhere it points to
            self._clients.append(httpx.AsyncClient(timeout=self.timeout, limits=ONE_CONNECTION, headers=self.headers,
                                                   verify=self._ssl, follow_redirects=False))
        return self._clients[index]

    async def agenerate(self, requests: list[GenRequest], params: SamplingParams, *,
                        on_result: ResultCallback | None = None, should_stop: StopCheck | None = None) -> list[GenResult]:
        """The requests on ``concurrency`` slots; runs on the engine's loop (see :meth:`generate`)."""
        pending = deque(requests)
        results: list[GenResult] = []
        stopped = False

        async def slot(client: httpx.AsyncClient) -> None:
            nonlocal stopped
            while pending and not stopped:
                if should_stop and should_stop():
                    stopped = True
                    return
                req = pending.popleft()
                res = await self._request(client, req, params)
                results.append(res)
                if on_result:
                    on_result(res)

        slots = min(await self.slots(params.max_new_tokens), len(requests))
        await asyncio.gather(*(slot(self._client(i)) for i in range(slots)))
        return results

    async def slots(self, max_new_tokens: int) -> int:
        """Requests kept in flight: the configured concurrency, else sized from the server's capacity."""
        if self.concurrency is not None:
            return self.concurrency
        if self._server_tokens is None:
            self._server_tokens = (await server_kv_tokens(self._client(0), self.base_url),)
            log.info("server capacity", extra={"kv_tokens": self._server_tokens[0],
                                               "concurrency": concurrency_for(self._server_tokens[0], max_new_tokens)})
        return concurrency_for(self._server_tokens[0], max_new_tokens)

    def body(self, req: GenRequest, params: SamplingParams) -> dict:
        return {"model": self.model_name, "messages": req.messages, "temperature": params.temperature,
                "top_p": params.top_p, "max_tokens": params.max_new_tokens, "seed": req.seed, "n": 1,
                "chat_template_kwargs": {"enable_thinking": params.thinking}, **self.extra_body}

    async def _request(self, client: httpx.AsyncClient, req: GenRequest, params: SamplingParams) -> GenResult:
        body = self.body(req, params)
        attempts = 0

        async def attempt() -> GenResult | _Retry:
            nonlocal attempts
            attempts += 1
            try:
                resp = await client.post(self.url, json=body)
            except httpx.TimeoutException as exc:
                return _Retry(f"timeout: {type(exc).__name__}", "timeout")
            except httpx.TransportError as exc:
                return _Retry(f"connection error: {type(exc).__name__}: {exc}", "connection")
            if resp.status_code == 200:
                return self._parse(req, resp, attempts)
            error = f"HTTP {resp.status_code}: " + resp.text[:300].replace("\n", " ")
            if resp.status_code != 429 and resp.status_code < 500:
                return GenResult(id=req.id, error=error, attempts=attempts)
            return _Retry(error, str(resp.status_code), parse_retry_after(resp.headers.get("retry-after")))

        def pause(state: RetryCallState) -> float:  # what Retry-After asks (at most 300 s), else the backoff
            retry_after = state.outcome.result().retry_after
            return min(retry_after, 300.0) if retry_after is not None else self._backoff(state.attempt_number - 1)

        def counted(state: RetryCallState) -> None:
            retry = state.outcome.result()
            RETRIES.labels(retry.reason).inc()
            log.debug("retrying request", extra={"id": req.id, "attempt": state.attempt_number, "error": retry.error,
                                                 "delay_s": round(state.next_action.sleep, 3)})

        def failed(state: RetryCallState) -> GenResult:
            return GenResult(id=req.id, error=f"failed after {attempts} attempts; last: {state.outcome.result().error}",
                             attempts=attempts)

        return await AsyncRetrying(stop=stop_after_attempt(self.max_retries + 1), wait=pause,
                                   retry=retry_if_result(lambda r: isinstance(r, _Retry)), before_sleep=counted,
                                   retry_error_callback=failed)(attempt)

    def _backoff(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_base_s * 2 ** attempt) * (0.5 + random.random() / 2)

    def _parse(self, req: GenRequest, resp: httpx.Response, attempts: int) -> GenResult:
        try:
            data = resp.json()
            choice = data["choices"][0]
            msg = choice.get("message") or {}
            content = msg.get("content") or ""
            reasoning = msg.get("reasoning_content")
            if reasoning is None:
                reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning, content, _closed = split_thinking(content)
            usage = data.get("usage") or {}
            return GenResult(id=req.id, content=content, reasoning=reasoning,
                             finish_reason=choice.get("finish_reason") or "stop",
                             prompt_tokens=int(usage.get("prompt_tokens") or 0),
                             completion_tokens=int(usage.get("completion_tokens") or 0), attempts=attempts)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            return GenResult(id=req.id, error=f"malformed response: {type(exc).__name__}: {exc}", attempts=attempts)


def _uvloop_factory():
    """uvloop's event loop when installed (it comes with uvicorn[standard]): less overhead per request."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
