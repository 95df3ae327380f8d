"""A real OpenAI-compatible chat-completions HTTP server on loopback, for tests and the benchmark.

Plain asyncio HTTP/1.1 with keep-alive. Each answer is derived from the request (so tests can
check it), after a fixed ``latency``. Faults are injected by markers in the last user message:

* ``[[429xN]]`` / ``[[500xN]]`` / ``[[timeoutxN]]``: the first N attempts of that prompt answer
  429 (with ``Retry-After: 0``), 500, or stall past the client's timeout; later attempts succeed;
* ``[[always500]]``: every attempt answers 500 (the prompt ends in the errors file);
* ``[[400]]``: a non-retryable client error;
* ``[[length]]``: the completion is cut off (``finish_reason: length``).

``reasoning="field"`` returns the reasoning in ``message.reasoning_content`` (vLLM / SGLang with
a reasoning parser); ``"inline"`` returns ``<think>...</think>`` inside the content.
Run as a script (``python openai_server.py --port P --latency S``) to serve from its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading
from collections import Counter


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (uvicorn[standard] brings it): the server's own overhead stays small."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


FAULT_RE = re.compile(r"\[\[(429|500|timeout)x(\d+)\]\]")


class LoopbackOpenAI:
    def __init__(self, latency: float = 0.0, reasoning: str = "field", stall_s: float = 5.0, port: int = 0,
                 kv_tokens: int | None = None):
        self.latency = latency
        self.kv_tokens = kv_tokens  # published on /metrics as vLLM does (16-token blocks); None: no /metrics
        self.reasoning = reasoning
        self.stall_s = stall_s
        self.port = port
        self.attempts: Counter[str] = Counter()
        self.status_counts: Counter[int] = Counter()
        self.bodies: list[dict] = []
        self.authorizations: list[str | None] = []  # the Authorization header of every request, in order
        self.in_flight = 0
        self.max_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # lifecycle (background thread with its own loop)

    def start(self) -> LoopbackOpenAI:
        ready = threading.Event()

        def main():
            self._loop = new_event_loop()
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", self.port, backlog=1024))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown():
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # HTTP

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.authorizations.append(headers.get("authorization"))
                status, payload, extra = await self._respond(method, path, body)
                text = isinstance(payload, str)
                data = payload.encode() if text else json.dumps(payload).encode()
                kind = "text/plain; version=0.0.4" if text else "application/json"
                head_out = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'ERR'}", f"Content-Type: {kind}",
                            f"Content-Length: {len(data)}", "Connection: keep-alive", *extra]
                writer.write(("\r\n".join(head_out) + "\r\n\r\n").encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError, ValueError):
            pass
        finally:
            writer.close()

    async def _respond(self, method: str, path: str, body: bytes) -> tuple[int, dict | str, list[str]]:
        if method == "GET" and path == "/metrics" and self.kv_tokens is not None:
            return 200, ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",'
                         f'cache_dtype="auto",num_gpu_blocks="{self.kv_tokens // 16}"}} 1.0\n'), []
        if method != "POST" or not path.endswith("/chat/completions"):
            return 404, {"error": {"message": f"no route {method} {path}"}}, []
        req = json.loads(body)
        self.bodies.append(req)
        user = next(m["content"] for m in reversed(req["messages"]) if m["role"] == "user")
        key = f"{user}\x00{req.get('seed')}"
        self.attempts[key] += 1
        attempt = self.attempts[key]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.latency:
                await asyncio.sleep(self.latency)
            for kind, n in FAULT_RE.findall(user):
                if attempt <= int(n):
                    if kind == "timeout":
                        await asyncio.sleep(self.stall_s)
                    code = 429 if kind == "429" else 500
                    self.status_counts[code] += 1
                    return code, {"error": {"message": f"injected {kind}"}}, (["Retry-After: 0"] if code == 429 else [])
            if "[[always500]]" in user:
                self.status_counts[500] += 1
                return 500, {"error": {"message": "injected permanent 500"}}, []
            if "[[400]]" in user:
                self.status_counts[400] += 1
                return 400, {"error": {"message": "injected bad request"}}, []
            self.status_counts[200] += 1
            return 200, self._completion(req, user), []
        finally:
            self.in_flight -= 1

    def _completion(self, req: dict, user: str) -> dict:
        thinking = (req.get("chat_template_kwargs") or {}).get("enable_thinking", True)
        reasoning = f"thinking about: {user}" if thinking else None
        answer = f"answer to: {user}"
        finish = "length" if "[[length]]" in user else "stop"
        message = {"role": "assistant", "content": answer}
        if reasoning is not None and self.reasoning == "field":
            message["reasoning_content"] = reasoning
        elif reasoning is not None:
            message["content"] = f"<think>\n{reasoning}\n</think>\n\n{answer}"
        prompt_tokens = sum(len(m["content"].split()) for m in req["messages"])
        completion_tokens = len(answer.split()) + len((reasoning or "").split())
        return {"id": "chatcmpl-test", "object": "chat.completion", "model": req.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency", type=float, default=0.0)
    ap.add_argument("--reasoning", choices=["field", "inline"], default="field")
    args = ap.parse_args()
    server = LoopbackOpenAI(latency=args.latency, reasoning=args.reasoning, port=args.port).start()
    print(f"listening on {server.base_url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
