"""The parts ``bench_adapt.py`` runs: the domain's prompts, the capture and the services as their own processes,
and τ read from a real vLLM's speculative-decoding counters, one request at a time.

τ here is the target's tokens per verify step of each request: its completion tokens over its steps, a step
being one target forward that yields one token of its own and the draft tokens it accepted (steps = tokens -
accepted drafts, the prefill's step included). It counts the steps where nothing was proposed (n-gram
speculation finding no match) as the one token they give; vLLM's own acceptance length (1 + accepted / drafts,
as ``serve-check`` reads it) leaves them out and is reported beside it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import _common  # noqa: F401 - import path

PROMPT = ("Complete this Python function, `{qualname}` of the standard library's `{module}` module. Reply with the "
          "whole function in a Python code block.\n\n```python\n{head}\n```")


PRINCIPAL = "adapt"  # the name of the API key the adapt run uses


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dfp_cli.main", *args]


# the domain

def signature_and_docstring(source: str) -> str | None:
    """A function's source up to the end of its docstring (decorators and signature included); None when the
    docstring is all the body holds (nothing to complete) or the source does not parse alone."""
    try:
        fn = ast.parse(source).body[0]
    except (SyntaxError, ValueError, IndexError):
        return None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(fn.body) < 2:
        return None
    return "\n".join(source.splitlines()[:fn.body[0].end_lineno])


def domain_prompts(n: int, seed: int = 0) -> list[dict]:
    """``n`` "complete this function" chat prompts, each a documented function of the running interpreter's standard
    library (:mod:`dfp_dev.targets.stdlib_corpus`) cut after its docstring, picked by a seeded hash of the function's
    name across the whole library."""
    from dfp_dev.targets.stdlib_corpus import stdlib_functions

    records = sorted(stdlib_functions(), key=lambda r: hashlib.sha256(f"{seed}:{r.id}".encode()).hexdigest())
    out = []
    for record in records:
        head = signature_and_docstring(record.source)
        if head is None:
            continue
        text = PROMPT.format(qualname=record.qualname, module=record.module, head=head)
        out.append({"id": record.id, "messages": [{"role": "user", "content": text}]})
        if len(out) == n:
            break
    if len(out) < n:
        raise SystemExit(f"the standard library gives {len(out)} functions to complete; {n} asked")
    return out


# the services: the capture in front of vLLM, then the API and its workers

@dataclass
class Stack:
    """The API and its workers (generation, tokenizer, trainer) on a private Redis, as their own processes."""

    group: object  # dfp_dev.local.processes.ProcessGroup
    redis: object  # dfp_dev.local.redis_server.RedisServer
    api_url: str
    api_key: str
    env: dict = field(default_factory=dict)

    def stop(self) -> None:
        self.group.stop_all(timeout=20)
        self.redis.stop()


def service_env(store: Path, model_dir: Path) -> dict:
    services = str(Path(__file__).resolve().parents[2] / "services")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (services, env.get("PYTHONPATH")) if p),
            "DFLASH_STORAGE_URL": f"file://{store}", "DFLASH_ALLOWED_PREFIXES": f"file://{model_dir}",
            "DFLASH_LOG_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def start_capture(group, env: dict, upstream: str, prefix: str) -> str:
    """``dflash-pipeline capture serve`` in front of ``upstream``, capturing every request; returns its base URL."""
    from dfp_dev.local.redis_server import free_port, wait_for_port

    port = free_port()
    group.start("capture", cli("capture", "serve", "--upstream", upstream), {
        **env, "DFLASH_CAPTURE_ENABLED": "true", "DFLASH_CAPTURE_PREFIX": prefix, "DFLASH_CAPTURE_HOST": "127.0.0.1",
        "DFLASH_CAPTURE_PORT": str(port), "DFLASH_CAPTURE_WORKER": "bench", "DFLASH_CAPTURE_FLUSH_INTERVAL_S": "1",
        "DFLASH_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"})
    wait_for_port(port, timeout=60)
    return f"http://127.0.0.1:{port}"


def start_stack(env: dict, logs: Path, timeout: float = 180.0) -> Stack:
    """Redis, ``api serve``, and the ``generation``, ``tokenizer`` and ``trainer`` workers, with one API key of the
    read and write scopes; returns once the API is ready."""
    import httpx
    from dfp_dev.local.processes import ProcessGroup
    from dfp_dev.local.redis_server import RedisServer, free_port

    redis = RedisServer().start()
    key = "dfp_" + secrets.token_urlsafe(24)
    port = free_port()
    env = {**env, "DFLASH_REDIS_URL": redis.url,
           "DFLASH_API_KEYS": json.dumps([{"name": PRINCIPAL, "sha256": hashlib.sha256(key.encode()).hexdigest(),
                                           "scopes": ["read", "write"]}])}
    light = {**env, "OMP_NUM_THREADS": "1"}  # the trainer (training, evaluation) has the cores
    group = ProcessGroup(logs)
    group.start("api", cli("api", "serve", "--host", "127.0.0.1", "--port", str(port)), light)
    group.start("generation", cli("generation", "worker", "--device", "cpu"), light)
    group.start("tokenizer", cli("tokenizer", "worker", "--processes", "1"), light)
    group.start("trainer", cli("trainer", "worker", "--device", "cpu"), env)
    stack = Stack(group, redis, f"http://127.0.0.1:{port}", key, env)
    deadline = time.monotonic() + timeout
    while True:
        try:
            group.check_alive()
            if httpx.get(f"{stack.api_url}/readyz", timeout=2).status_code == 200:
                return stack
        except httpx.HTTPError:
            pass
        except RuntimeError:
            stack.stop()
            raise
        if time.monotonic() > deadline:
            stack.stop()
            raise TimeoutError(f"the API was not ready within {timeout:.0f} s; logs under {logs}")
        time.sleep(0.5)


def job_seconds(stack: Stack) -> dict:
    """Wall seconds of every job the run submitted (started to finished), by type; repeated types numbered."""
    import httpx

    resp = httpx.get(f"{stack.api_url}/v1/jobs", params={"limit": 100}, timeout=30,
                     headers={"Authorization": f"Bearer {stack.api_key}"})
    out: dict[str, float] = {}
    for job in sorted(resp.json()["items"], key=lambda j: j["created_at"]):
        if job["started_at"] is None or job["finished_at"] is None:
            continue
        name, n = job["type"], 2
        while name in out:
            name, n = f"{job['type']}-{n}", n + 1
        out[name] = round(job["finished_at"] - job["started_at"], 1)
    return out


# τ from vLLM's counters

@dataclass
class Served:
    """One request's answer and its speculative decoding: completion tokens, drafts and accepted draft tokens."""

    id: str
    token_ids: list[int]
    tokens: int
    drafts: float
    accepted: float

    @property
    def tau(self) -> float:
        steps = self.tokens - self.accepted
        return self.tokens / steps if steps > 0 else float("nan")


def chat(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "seed": 0,
            "return_token_ids": True}
    resp = client.post("/v1/chat/completions", json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"chat completion answered {resp.status_code}: {resp.text[:500]}")
    return resp.json()


def serve_one_by_one(server, base_url: str, model: str, prompts: list[dict], max_tokens: int) -> list[Served]:
    """Each prompt sent alone to ``base_url`` (vLLM, or the capture in front of it), its counters read from
    ``server`` before and after."""
    import httpx

    rows = []
    with httpx.Client(base_url=base_url, timeout=900) as client:
        for prompt in prompts:
            before = server.spec_counters()
            answer = chat(client, model, prompt["messages"], max_tokens)
            delta = server.spec_counters() - before
            rows.append(Served(prompt["id"], answer["choices"][0].get("token_ids") or [],
                               int(answer["usage"]["completion_tokens"]), delta.drafts, delta.accepted))
    return rows


def tau_figures(rows: list[Served]) -> dict:
    """τ over all the requests (their tokens over their steps), vLLM's acceptance length, and per prompt."""
    tokens, accepted, drafts = (sum(getattr(r, k) for r in rows) for k in ("tokens", "accepted", "drafts"))
    return {"tau": tokens / (tokens - accepted) if tokens > accepted else float("nan"),
            "acceptance_length": 1 + accepted / drafts if drafts else float("nan"),
            "tokens": tokens, "accepted": accepted, "drafts": drafts, "per_prompt": {r.id: r.tau for r in rows}}


def paired_noise(after: dict[str, float], before: dict[str, float]) -> tuple[float, float, int]:
    """Mean of the per-prompt τ differences and its standard error (the paired comparison's noise)."""
    ids = [i for i in after if i in before and math.isfinite(after[i]) and math.isfinite(before[i])]
    diffs = [after[i] - before[i] for i in ids]
    if len(diffs) < 2:
        return float("nan"), float("nan"), len(diffs)
    mean = sum(diffs) / len(diffs)
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
    return mean, se, len(diffs)


def trimmed(ids: list[int], stops: set[int]) -> list[int]:
    """Up to the first stop token, without it (engines differ in whether they return it)."""
    for i, tok in enumerate(ids):
        if tok in stops:
            return ids[:i]
    return list(ids)
