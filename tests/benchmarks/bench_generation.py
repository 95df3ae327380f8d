"""Benchmark: completions/s of the ``openai`` engine against a loopback server with fixed latency.

project  = the engine at its configured concurrency (bounded async requests over keep-alive);
baseline = one request at a time (a plain synchronous loop, how a script would do it);
limit    = concurrency / latency (every slot busy all the time, zero overhead).

The server runs in its own process (tests/generation/openai_server.py). Requests finish in
waves (all slots start together), so each wave pays the CPU time of answering ``concurrency``
responses at once; the default 2 s latency keeps that small next to the latency, as a real
thinking-mode completion (tens of seconds) does. Runs in about half a minute on 2 cores:
``python tests/benchmarks/bench_generation.py`` (``--latency 0.25`` shows the per-wave cost).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "services"), str(ROOT)]

import httpx  # noqa: E402
from dfp_generation.engines import GenRequest, SamplingParams  # noqa: E402
from dfp_generation.engines.openai_engine import OpenAIEngine  # noqa: E402

from tests.support.servers import free_port, wait_for_port  # noqa: E402


def requests(n: int, tag: str) -> list[GenRequest]:
    return [GenRequest(f"{tag}{i}", [{"role": "user", "content": f"prompt {tag} {i}"}], i) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency", type=float, default=2.0,
                    help="Server latency per request, seconds (a thinking-mode completion takes far longer).")
    ap.add_argument("--concurrency", type=int, default=64, help="Requests in flight (the engine's setting).")
    ap.add_argument("--requests", type=int, default=0, help="Requests of the project run (default 8 x concurrency).")
    ap.add_argument("--baseline-requests", type=int, default=3, help="Requests of the one-at-a-time run.")
    args = ap.parse_args()
    n = args.requests or 8 * args.concurrency
    params = SamplingParams(temperature=0.6, top_p=0.95, max_new_tokens=64, thinking=True)

    port = free_port()
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "generation" / "openai_server.py"),
                               "--port", str(port), "--latency", str(args.latency)],
                              stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for_port(port)
        base = f"http://127.0.0.1:{port}/v1"
        engine = OpenAIEngine(base, "target", concurrency=args.concurrency, timeout_s=60, max_retries=0)
        engine.generate(requests(args.concurrency, "warm"), params)  # open the connections (kept across calls)

        start = time.perf_counter()
        results = engine.generate(requests(n, "p"), params)
        project_s = time.perf_counter() - start
        assert len(results) == n and all(r.ok for r in results), [r.error for r in results if not r.ok][:3]

        with httpx.Client(timeout=60) as client:  # baseline: one request at a time
            start = time.perf_counter()
            for req in requests(args.baseline_requests, "b"):
                resp = client.post(base + "/chat/completions", json=engine.body(req, params))
                resp.raise_for_status()
            baseline_s = time.perf_counter() - start
        engine.close()
    finally:
        server.terminate()
        server.wait(10)

    project = n / project_s
    baseline = args.baseline_requests / baseline_s
    limit = args.concurrency / args.latency
    print(f"openai engine: {n} completions in {project_s:.2f}s at concurrency {args.concurrency}, "
          f"latency {args.latency}s; one at a time: {baseline:.2f}/s", file=sys.stderr)
    print(json.dumps({"benchmark": "generation", "unit": "completions/s", "project": round(project, 3),
                      "baseline": round(baseline, 3), "limit": round(limit, 3),
                      "vs_baseline": round(project / baseline, 3), "vs_limit": round(project / limit, 3),
                      "concurrency": args.concurrency, "latency_s": args.latency, "requests": n}))


if __name__ == "__main__":
    main()
