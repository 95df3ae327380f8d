"""Benchmark: GET /v1/jobs/{id} under concurrent load on loopback.

Three servers, each one uvicorn process with the production settings of ``dflash-pipeline api
serve`` (uvloop, httptools, no access log, one worker), loaded in turn by the same async
load generator (50 keep-alive connections, raw HTTP/1.1) for the same time:

* project  - ``dflash-pipeline api serve``: bearer-key auth, Redis rate limit, async Redis read of
  the job record, progress/ETA, response model, metrics middleware;
* baseline - the naive way: a FastAPI route in a sync ``def`` (thread pool) reading the record with
  the sync redis client, no auth or rate limit;
* limit    - a bare FastAPI ``async def`` endpoint returning a constant.

All three run side by side; rounds interleave them (each server's median round counts), so a
change in the machine's load affects all three alike. Figures: requests/s (higher is better) and
p99 latency; also each server's CPU time per request (``vs_limit_cpu`` = limit's / project's),
which a busy machine disturbs far less than requests/s. Goal: vs_limit >= 0.5, p99 < 50 ms.
Run: ``python tests/benchmarks/bench_api.py [--seconds 4] [--rounds 3] [--clients 50]``; last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "services"), str(ROOT)]

from tests.benchmarks._common import process_cpu_s, start_server  # noqa: E402

KEY = "dfp_bench-key-000000000000000000"
NAMES = ("project", "baseline", "limit")


# servers of the baseline and the limit (run in a child process)

def serve_reference(kind: str, port: int, redis_url: str) -> None:
    import redis
    import uvicorn
    from dfp_shared.jobs.store import JobStore
    from fastapi import FastAPI

    app = FastAPI()
    if kind == "limit":
        @app.get("/v1/jobs/{job_id}")
        async def constant(job_id: str):
            return {"id": job_id, "state": "running"}
    else:
        store = JobStore(redis.Redis.from_url(redis_url, decode_responses=True))

        @app.get("/v1/jobs/{job_id}")
        def naive(job_id: str):
            return store.get(job_id).to_dict()

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning")


# load generator

async def _client(host: str, port: int, path: str, headers: str, stop_at: float, lat: list, errors: list) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{headers}\r\n".encode()
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            lat.append(time.perf_counter() - t0)
            if status != 200:
                errors.append(status)
    finally:
        writer.close()


async def load(port: int, path: str, headers: str, clients: int, seconds: float, warmup: float) -> dict:
    warm_lat: list = []
    await asyncio.gather(*[_client("127.0.0.1", port, path, headers, time.perf_counter() + warmup, warm_lat, [])
                           for _ in range(clients)])
    lat: list = []
    errors: list = []
    start = time.perf_counter()
    await asyncio.gather(*[_client("127.0.0.1", port, path, headers, start + seconds, lat, errors)
                           for _ in range(clients)])
    elapsed = time.perf_counter() - start
    lat.sort()
    return {"rps": len(lat) / elapsed, "warmup_requests": len(warm_lat), "p50_ms": 1000 * lat[len(lat) // 2], "p99_ms": 1000 * lat[int(len(lat) * 0.99)],
            "requests": len(lat), "errors": len(errors)}




def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="Measured seconds per server and round.")
    ap.add_argument("--warmup", type=float, default=1.0, help="Unmeasured seconds before each measurement.")
    ap.add_argument("--rounds", type=int, default=3, help="Rounds; the median round of each server counts.")
    ap.add_argument("--clients", type=int, default=50, help="Concurrent keep-alive connections.")
    ap.add_argument("--serve", choices=["limit", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve_reference(args.serve, args.port, args.redis_url)

    import uvloop
    from dfp_shared.jobs.store import JobStore
    from dfp_shared.jobs.submit import queue_job

    from tests.support.servers import RedisServer, free_port

    redis_server = RedisServer().start()
    try:
        r = redis_server.client()
        job, _ = queue_job(r, "tokenize", {"input": "s3://bench/completions/", "output": "s3://bench/tokens",
                                           "tokenizer": "/models/qwen3"}, owner="bench")
        jobs = JobStore(r)
        jobs.start(job.id)
        jobs.set_totals(job.id, files=1000, tasks=1000)
        for i in range(137):
            jobs.complete_task(job.id, f"part-{i:05d}.jsonl", files=1, samples=512, tokens=1_200_000)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), str(ROOT), env.get("PYTHONPATH", "")])
        path = f"/v1/jobs/{job.id}"
        servers = {}
        try:
            for name in NAMES:
                port = free_port()
                if name == "project":
                    entry = {"name": "bench", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "scopes": ["read"]}
                    cmd = [sys.executable, "-m", "dfp_cli.main", "api", "serve", "--host", "127.0.0.1",
                           "--port", str(port), "--redis-url", redis_server.url,
                           "--rate-limit-per-s", "1000000", "--rate-limit-burst", "1000000"]
                    proc = start_server(cmd, {**env, "DFLASH_API_KEYS": json.dumps([entry]), "DFLASH_LOG_LEVEL": "WARNING"},
                                  port)
                    headers = f"Authorization: Bearer {KEY}\r\n"
                else:
                    cmd = [sys.executable, __file__, "--serve", name, "--port", str(port), "--redis-url",
                           redis_server.url]
                    proc = start_server(cmd, env, port)
                    headers = ""
                servers[name] = (proc, port, headers)
            # rounds interleave the three servers, so a load change on the machine hits all of them
            rounds: dict[str, list[dict]] = {name: [] for name in NAMES}
            for i in range(args.rounds):
                for name in NAMES:
                    proc, port, headers = servers[name]
                    cpu0 = process_cpu_s(proc.pid)
                    res = uvloop.run(load(port, path, headers, args.clients, args.seconds, args.warmup))
                    cpu1 = process_cpu_s(proc.pid)
                    # server CPU per request (warm-up requests included in both terms): steady under
                    # machine load, unlike requests/s
                    res["cpu_us"] = (1e6 * (cpu1 - cpu0) / (res["requests"] + res["warmup_requests"])
                                     if cpu0 is not None and cpu1 is not None else None)
                    rounds[name].append(res)
                    print(f"round {i + 1} {name:>8}: {res['rps']:8.0f} req/s  p50 {res['p50_ms']:6.1f} ms  "
                          f"p99 {res['p99_ms']:6.1f} ms  server CPU {res['cpu_us'] or 0:6.0f} us/request  "
                          f"({res['requests']} requests, {res['errors']} non-200)",
                          flush=True)
        finally:
            for proc, _, _ in servers.values():
                proc.terminate()
                proc.wait(15)
        results = {name: sorted(rs, key=lambda r: r["rps"])[len(rs) // 2] for name, rs in rounds.items()}
    finally:
        redis_server.stop()
    p, b, lim = (results[k]["rps"] for k in ("project", "baseline", "limit"))
    print(json.dumps({
        "benchmark": "api", "unit": "requests/s", "project": round(p, 1), "baseline": round(b, 1), "limit": round(lim, 1),
        "vs_baseline": round(p / b, 3), "vs_limit": round(p / lim, 3),
        "p99_ms_project": round(results["project"]["p99_ms"], 2), "p99_ms_baseline": round(results["baseline"]["p99_ms"], 2),
        "p99_ms_limit": round(results["limit"]["p99_ms"], 2), "clients": args.clients,
        "seconds_per_round": args.seconds, "rounds": args.rounds,
        **({"cpu_us_per_request": {k: round(_median([r["cpu_us"] for r in rounds[k]]), 1) for k in NAMES},
            "vs_limit_cpu": round(_median([r["cpu_us"] for r in rounds["limit"]])
                                  / _median([r["cpu_us"] for r in rounds["project"]]), 3)}
           if all(r["cpu_us"] for rs in rounds.values() for r in rs) else {}),
        "errors": sum(r["errors"] for rs in rounds.values() for r in rs),
    }))


if __name__ == "__main__":
    main()
