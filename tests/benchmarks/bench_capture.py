"""Benchmark: streamed chat completions through the capture pass-through against the upstream directly.

Two processes on loopback, each one uvicorn server: a fast OpenAI-compatible upstream that streams
``--tokens`` content events per request (``data: {json}`` chunks, then the finish event and
``data: [DONE]``) with ``--delay-ms`` between events, and ``dflash-pipeline capture serve`` in front of it
with capture on for all traffic (``DFLASH_CAPTURE_ENABLED=true``, a ``file://`` prefix in a temporary
directory, the other settings at their defaults). One load generator (``--streams`` keep-alive
connections, raw HTTP/1.1, each posting a streamed chat completion as soon as its last one ended) loads
the upstream directly, then through the capture, for ``--seconds`` each; rounds alternate the order
(direct, capture; capture, direct; ...) so a change in the machine's load affects both. The same client,
upstream and concurrency serve every side. ``--bare-relay`` adds a third side, a bare TCP relay (uvloop,
no HTTP) in front of the same upstream: what one more hop costs on this machine whatever the proxy does.

Figures: content tokens/s of whole replies over all rounds (project: through the capture; baseline and
limit: direct, so ``vs_limit`` is the capture's share of direct throughput; goal >= 0.95), latency to the
first byte of the reply and to its end (p50, p99; ``p99_added_ms`` = p99 through the capture - p99 direct,
likewise ``p50_added_ms``; ``p99_added_ms_per_round`` the same within each round, which a burst of the
machine's other load in one round moves less), CPU time per request (steady under machine load, unlike tokens/s) of the
capture during its rounds (``capture_cpu_us_per_request``) and over the whole run including the writes
of its records (``capture_cpu_us_per_request_all``: from the warm-up to its exit, over every reply it
relayed), of the upstream and of the load generator on each side (on a machine with few cores the three
share them: the capture's CPU is taken from the upstream's and the client's), ``captured_records``
(lines written under the prefix once the capture has stopped and flushed) beside the requests it
relayed, and ``dropped`` (``dfp_capture_dropped_total`` from its /metrics).
Run: ``python tests/benchmarks/bench_capture.py [--streams 64] [--rounds 3] [--seconds 8] [--tokens 64]
[--bare-relay] [--no-record]``;
last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "services"), str(ROOT)]

from tests.benchmarks._common import process_cpu_s, report, start_server  # noqa: E402

MODEL = "bench-target"
SIDES = ("direct", "capture")


# the upstream (run in a child process)

def serve_upstream(port: int, tokens: int, delay_s: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def event(delta: dict, finish=None) -> bytes:
        body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    words = [event({"content": f"tok{i} "}) for i in range(tokens)]

    async def events():
        yield event({"role": "assistant", "content": ""})
        for chunk in words:
            await asyncio.sleep(delay_s)
            yield chunk
        yield event({}, finish="length")
        yield b"data: [DONE]\n\n"

    async def chat(request):
        req = json.loads(await request.body())
        if not req.get("stream"):
            return JSONResponse({"error": {"message": "this upstream only streams"}}, 400)
        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request):
        return Response(b"", status_code=200)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning")


def serve_bare_relay(port: int, upstream_port: int) -> None:
    """A bare TCP relay (uvloop, no HTTP): what any extra hop costs on this machine, the floor of a proxy."""
    import uvloop

    class Pipe(asyncio.Protocol):
        def __init__(self, peer: Pipe | None = None):
            self.peer, self.transport, self.early = peer, None, []

        def connection_made(self, transport):
            self.transport = transport
            if self.peer is None:  # the client's side: dial the upstream, hold what arrives meanwhile
                asyncio.ensure_future(self.dial())
            else:
                self.peer.peer = self
                for data in self.peer.early:
                    transport.write(data)

        async def dial(self):
            await asyncio.get_running_loop().create_connection(lambda: Pipe(self), "127.0.0.1", upstream_port)

        def data_received(self, data):
            if self.peer is None or self.peer.transport is None:
                self.early.append(data)
            else:
                self.peer.transport.write(data)

        def connection_lost(self, exc):
            if self.peer is not None and self.peer.transport is not None:
                self.peer.transport.close()

    async def main():
        server = await asyncio.get_running_loop().create_server(Pipe, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


# load generator

def _request(port: int, tokens: int, n: int) -> bytes:
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Count to {tokens}, please (stream {n})."}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _read_chunked(reader: asyncio.StreamReader, t0: float) -> tuple[bytes, float]:
    """The body of a chunked reply and the time its first bytes arrived."""
    parts, first = [], 0.0
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts), first
        data = await reader.readexactly(size + 2)
        if not first:
            first = time.perf_counter() - t0
        parts.append(data[:-2])


async def _stream(port: int, n: int, tokens: int, stop_at: float, out: dict) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = _request(port, tokens, n)
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            lower = head.lower()
            if b"transfer-encoding: chunked" in lower:
                body, ttfb = await _read_chunked(reader, t0)
            else:
                length = int(re.search(rb"content-length: *(\d+)", lower).group(1))
                body, ttfb = await reader.readexactly(length), time.perf_counter() - t0
            total = time.perf_counter() - t0
            events = body.count(b"data: ")
            if status != 200 or not body.endswith(b"data: [DONE]\n\n") or events != tokens + 3:
                out["errors"] += 1
                continue
            out["ttfb"].append(ttfb)
            out["total"].append(total)
            out["tokens"] += tokens
    finally:
        writer.close()


async def load(port: int, streams: int, tokens: int, seconds: float) -> dict:
    out = {"ttfb": [], "total": [], "tokens": 0, "errors": 0}
    start = time.perf_counter()
    await asyncio.gather(*[_stream(port, n, tokens, start + seconds, out) for n in range(streams)])
    out["elapsed"] = time.perf_counter() - start  # the last replies begun before the end are waited for
    return out


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return 1000 * values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")




def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith(name + "_created"))


def _scrape(port: int) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def _stop(proc: subprocess.Popen) -> float | None:
    """Stop a server (SIGTERM, then SIGKILL after 30 s); returns the CPU seconds it used in all, read before
    its exit status is collected."""
    if proc.poll() is not None:
        return None
    proc.send_signal(signal.SIGTERM)
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: its times still read
        cpu = process_cpu_s(proc.pid)
        proc.wait(30)
    except (subprocess.TimeoutExpired, ChildProcessError, OSError):
        proc.kill()
        proc.wait()
        return None
    return cpu


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64, help="Concurrent streams (keep-alive connections).")
    ap.add_argument("--rounds", type=int, default=3, help="Rounds, each one measurement of both sides.")
    ap.add_argument("--seconds", type=float, default=8.0, help="Measured seconds per side and round.")
    ap.add_argument("--tokens", type=int, default=64, help="Content events (tokens) per reply.")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="Upstream's pause before each token.")
    ap.add_argument("--warmup", type=float, default=2.0, help="Unmeasured seconds on each side before round 1.")
    ap.add_argument("--no-record", action="store_true",
                    help="Run the capture with capture off (relaying only), to tell relaying from recording.")
    ap.add_argument("--bare-relay", action="store_true",
                    help="Also measure a bare TCP relay in each round (the cost of any extra hop on this machine).")
    ap.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-bare-relay", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return ap.parse_args()


def _cpu(pids: dict[str, int]) -> dict[str, float | None]:
    """CPU seconds so far of the capture, the upstream and this process (the load generator)."""
    return {**{name: process_cpu_s(pid) for name, pid in pids.items()}, "client": time.process_time()}


def _measure(args, ports: dict[str, int], pids: dict[str, int]) -> tuple[dict[str, list[dict]], int, float | None]:
    """The warm-up and the rounds (the sides' order reversed every other round); returns the rounds, the replies relayed through the capture
    and its CPU seconds when the warm-up began."""
    import uvloop

    sides = tuple(ports)
    relayed, start_cpu = 0, process_cpu_s(pids["capture"])
    for side in sides:
        warm = uvloop.run(load(ports[side], args.streams, args.tokens, args.warmup))
        relayed += len(warm["total"]) if side == "capture" else 0
    rounds: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(args.rounds):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            cpu0 = _cpu(pids)
            res = uvloop.run(load(ports[side], args.streams, args.tokens, args.seconds))
            cpu1 = _cpu(pids)
            res["cpu_s"] = {k: (cpu1[k] - cpu0[k]) if cpu0[k] is not None and cpu1[k] is not None else None
                            for k in cpu0}
            rounds[side].append(res)
            if side == "capture":
                relayed += len(res["total"])
            print(f"round {i + 1} {side:>7}: {res['tokens'] / res['elapsed']:8.0f} tokens/s  "
                  f"ttfb p50 {_pct(res['ttfb'], .5):6.1f} p99 {_pct(res['ttfb'], .99):6.1f} ms  "
                  f"total p50 {_pct(res['total'], .5):6.1f} p99 {_pct(res['total'], .99):6.1f} ms  "
                  f"({len(res['total'])} replies, {res['errors']} bad)", flush=True)
    return rounds, relayed, start_cpu


def _cpu_per_request(rounds: list[dict], who: str) -> float | None:
    spent = [r["cpu_s"][who] for r in rounds]
    replies = sum(len(r["total"]) for r in rounds)
    return round(1e6 * sum(spent) / replies, 1) if replies and all(c is not None for c in spent) else None


def main() -> None:
    args = _parse()
    if args.serve_upstream:
        return serve_upstream(args.port, args.tokens, args.delay_ms / 1000)
    if args.serve_bare_relay:
        return serve_bare_relay(args.port, args.serve_bare_relay)

    from tests.support.servers import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "services"), str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as tmp:
        up_port, cap_port = free_port(), free_port()
        upstream = start_server([sys.executable, __file__, "--serve-upstream", "--port", str(up_port),
                                 "--tokens", str(args.tokens), "--delay-ms", str(args.delay_ms)], env, up_port)
        capture, bare, end_cpu = None, None, None
        ports = {"direct": up_port}
        try:
            if args.bare_relay:
                ports["bare"] = free_port()
                bare = start_server([sys.executable, __file__, "--serve-bare-relay", str(up_port),
                                     "--port", str(ports["bare"])], env, ports["bare"])
            capture = start_server(
                [sys.executable, "-m", "dfp_cli.main", "capture", "serve", "--upstream", f"http://127.0.0.1:{up_port}"],
                {**env, "DFLASH_STORAGE_URL": f"file://{tmp}", "DFLASH_CAPTURE_PREFIX": f"file://{tmp}/capture",
                 "DFLASH_CAPTURE_ENABLED": "false" if args.no_record else "true", "DFLASH_CAPTURE_HOST": "127.0.0.1",
                 "DFLASH_CAPTURE_PORT": str(cap_port), "DFLASH_CAPTURE_WORKER": "bench",
                 "DFLASH_LOG_LEVEL": "WARNING"}, cap_port)
            rounds, relayed, start_cpu = _measure(args, {**ports, "capture": cap_port},
                                                  {"capture": capture.pid, "upstream": upstream.pid,
                                                   **({"bare": bare.pid} if bare else {})})
            scraped = _scrape(cap_port)
        finally:
            if capture is not None:
                end_cpu = _stop(capture)  # the capture writes what it still holds as it stops
            if bare is not None:
                _stop(bare)
            _stop(upstream)
        captured = sum(sum(1 for line in p.read_text().splitlines() if line.strip())
                       for p in Path(tmp, "capture").rglob("*.jsonl"))
        shards = len(list(Path(tmp, "capture").rglob("*.jsonl")))
    total_cpu = (end_cpu - start_cpu) if end_cpu is not None and start_cpu is not None else None
    _report(args, rounds, scraped, captured_records=captured, relayed_replies=relayed, shards=shards,
            capture_cpu_us_per_request_all=round(1e6 * total_cpu / relayed, 1) if total_cpu and relayed else None)


def _report(args, rounds: dict[str, list[dict]], scraped: str, **extra) -> None:
    def pooled(side: str, key: str) -> list[float]:
        return [v for r in rounds[side] for v in r[key]]

    tput = {s: sum(r["tokens"] for r in rounds[s]) / sum(r["elapsed"] for r in rounds[s]) for s in rounds}
    ratios = sorted(c["tokens"] / c["elapsed"] / (d["tokens"] / d["elapsed"])
                    for d, c in zip(rounds["direct"], rounds["capture"]))
    lat = {f"{k}_{q}_ms_{s}": round(_pct(pooled(s, k), v), 2)
           for s in rounds for k in ("ttfb", "total") for q, v in (("p50", .5), ("p99", .99))}
    if "bare" in rounds:  # the floor: a bare TCP relay measured in the same rounds
        extra.update(bare_vs_direct=round(tput["bare"] / tput["direct"], 3),
                     bare_p50_added_ms=round(lat["total_p50_ms_bare"] - lat["total_p50_ms_direct"], 2),
                     bare_p99_added_ms=round(lat["total_p99_ms_bare"] - lat["total_p99_ms_direct"], 2),
                     bare_cpu_us_per_request=_cpu_per_request(rounds["bare"], "bare"))
    cpu = {f"{who}_cpu_us_per_request_{side}": _cpu_per_request(rounds[side], who)
           for who in ("upstream", "client") for side in SIDES}
    report("capture", "tokens/s", tput["capture"], baseline=tput["direct"], limit=tput["direct"],
           ratio_per_round=[round(r, 3) for r in ratios],
           p99_added_ms_per_round=[round(_pct(c["total"], .99) - _pct(d["total"], .99), 1)
                                   for d, c in zip(rounds["direct"], rounds["capture"])],
           p50_added_ms=round(lat["total_p50_ms_capture"] - lat["total_p50_ms_direct"], 2),
           p99_added_ms=round(lat["total_p99_ms_capture"] - lat["total_p99_ms_direct"], 2),
           ttfb_p99_added_ms=round(lat["ttfb_p99_ms_capture"] - lat["ttfb_p99_ms_direct"], 2),
           **lat, capture_cpu_us_per_request=_cpu_per_request(rounds["capture"], "capture"), **cpu, **extra,
           dropped=int(_metric(scraped, "dfp_capture_dropped_total")),
           records_written_before_stop=int(_metric(scraped, "dfp_capture_records_written_total")),
           errors=sum(r["errors"] for rs in rounds.values() for r in rs),
           recording=not args.no_record, streams=args.streams, tokens_per_reply=args.tokens, delay_ms=args.delay_ms,
           rounds=args.rounds, seconds_per_round=args.seconds, cpus=os.cpu_count(),
           load_average=[round(x, 2) for x in os.getloadavg()])


if __name__ == "__main__":
    main()
