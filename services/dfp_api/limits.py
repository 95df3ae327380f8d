"""The request body limit, enforced on the stream before anything parses the body.

A declared ``Content-Length`` over the limit is refused at once, unread; a chunked (or any other)
body is read up to the limit and refused as soon as it passes it. Either way the answer is a 413
with the API's error JSON, and the connection closes (the rest of the body is never read). A
request without a body (the hot GETs) passes straight through.
"""

from __future__ import annotations

import json


class BodyLimitMiddleware:
    """Pure ASGI: buffers a request body of at most ``max_bytes`` and hands it on in one message."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes
        self._refusal = json.dumps({
            "error": "payload_too_large",
            "message": f"request body is over the limit of {max_bytes} bytes (DFLASH_MAX_BODY_BYTES)",
        }).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared, streamed = None, False
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name == b"transfer-encoding":
                streamed = True
        if not streamed and (declared is None or declared == b"0"):
            return await self.app(scope, receive, send)
        if declared is not None and not streamed:
            try:
                if int(declared) > self.max_bytes:
                    return await self._refuse(send)
            except ValueError:
                pass  # the server's parser rejects a malformed length before this runs
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                first = message
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._refuse(send)
            parts.append(body)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        return await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(self._refusal)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": self._refusal})
