"""A limit on request body size: 413 in the OpenAI error shape, before the app reads it.

A pure ASGI middleware. A declared `content-length` over the limit is refused before a byte
of the body is read; a chunked body is read up to the limit and refused as soon as it goes
past it. A body within the limit is buffered (FastAPI reads whole bodies anyway) and
replayed to the app; after it, `receive` is the server's again, so the app still sees the
client's `http.disconnect`.
"""

from __future__ import annotations

import json

from roseray.config import DEFAULT_MAX_BODY_BYTES
from roseray.openai_api.errors import error_body


class BodyLimitMiddleware:
    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending its body
                await self.app(scope, replay_receive([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._refuse(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replay_receive([whole], receive), send)

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(413, f"the request body is larger than the limit of {self.max_body_bytes} bytes",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses such a request before it gets here
    return None


def replay_receive(messages: list[dict], receive):
    """`receive` that first returns `messages` (a body already read), then the server's own."""
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
