"""A small, honest OpenAI-compatible upstream (what vLLM and SGLang answer), for the capture tests.

Answers are derived from the request so tests can check them: the chat reply is ``echo: <last user text>``
with reasoning ``thinking about <text>``; a completion's is ``<prompt> and so on``. Streams are
server-sent events (``data: {json}\\n\\n`` chunks, then ``data: [DONE]``), as the engines send them.
Markers in the prompt: ``[[malformed]]`` (a body that is not JSON, or an event that is not), ``[[slow]]``
(a long stream with a pause between events), ``[[500]]`` (an error status), ``[[cut]]`` (a stream
broken off mid-reply).
"""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "tiny-target"


def _last_text(req: dict) -> str:
    if "messages" in req:
        return next(m["content"] for m in reversed(req["messages"]) if m["role"] == "user")
    return req["prompt"]


def _chunk(index_delta: dict, finish=None, chat=True) -> bytes:
    choice = {"index": 0, "delta": index_delta, "finish_reason": finish} if chat else \
        {"index": 0, "text": index_delta.get("content", ""), "finish_reason": finish}
    body = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
            "model": MODEL, "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _events(text: str, chat: bool, slow: bool, malformed: bool):
    if chat:
        yield _chunk({"role": "assistant", "content": ""})
        for word in f"thinking about {text}".split(" "):
            yield _chunk({"reasoning_content": word + " "})
    words = (f"echo: {text}" if chat else f"{text} and so on").split(" ")
    if slow:
        words = words + [f"w{i}" for i in range(200)]
    for word in words:
        yield _chunk({"content": word + " "}, chat=chat)
        if slow:
            await asyncio.sleep(0.02)
    if "[[cut]]" in text:
        raise ConnectionAbortedError("the engine went away mid-reply")
    if malformed:
        yield b"data: {broken\n\n"
    yield _chunk({}, finish="stop", chat=chat)
    yield b"data: [DONE]\n\n"


def _whole(text: str, chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": f"echo: {text}",
                                          "reasoning_content": f"thinking about {text}"}, "finish_reason": "stop"}
    else:
        choice = {"index": 0, "text": f"{text} and so on", "finish_reason": "length"}
    return {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion", "created": 1,
            "model": MODEL, "choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}


def make_app() -> Starlette:
    seen_headers: list[dict] = []

    async def reply(request: Request, chat: bool) -> Response:
        seen_headers.append(dict(request.headers))
        req = json.loads(await request.body())
        text = _last_text(req)
        if "[[500]]" in text:
            return JSONResponse({"error": {"message": "boom"}}, 500)
        malformed = "[[malformed]]" in text
        if req.get("stream"):
            return StreamingResponse(_events(text, chat, "[[slow]]" in text, malformed), media_type="text/event-stream")
        if malformed:
            return Response(b"<html>upstream hiccup</html>", media_type="application/json")
        return Response(json.dumps(_whole(text, chat)).encode(), media_type="application/json")

    async def chat(request):
        return await reply(request, True)

    async def completions(request):
        return await reply(request, False)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(request):
        return Response(b"", status_code=200)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models), Route("/health", health)])
    app.state.seen_headers = seen_headers
    return app
