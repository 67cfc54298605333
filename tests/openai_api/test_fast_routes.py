"""The generation fast path (roseray.openai_api.fast_routes): well-formed completion and chat
bodies are answered without FastAPI; everything else reaches FastAPI with its body intact."""

from __future__ import annotations

import asyncio
import json

from starlette.responses import JSONResponse

from roseray.openai_api.errors import APIError
from roseray.openai_api.fast_routes import GenerationFastPath
from roseray.openai_api.protocol import ChatCompletionRequest, CompletionRequest


class FakeServer:

    def __init__(self, error: APIError | None = None) -> None:
        self.bodies = []
        self.error = error

    async def generate(self, http_request, body):
        if self.error is not None:
            raise self.error
        self.bodies.append(body)
        return JSONResponse({"ok": type(body).__name__})


class Inner:
    """Stands in for FastAPI: records what reached it, including the body it reads."""

    def __init__(self) -> None:
        self.seen = []

    async def __call__(self, scope, receive, send):
        body = None
        if scope["method"] == "POST":
            body, message = b"", {"more_body": True}
            while message.get("more_body"):
                message = await receive()
                body += message["body"]
        self.seen.append((scope["path"], body))
        await JSONResponse({"ok": "fastapi"})(scope, receive, send)


def call(app, path: str, body: bytes = b"", *, method: str = "POST", content_type: bytes | None = b"application/json",
         root_path: str = "", chunks: int = 1):
    headers = [(b"content-type", content_type)] if content_type is not None else []
    scope = {"type": "http", "method": method, "path": root_path + path, "root_path": root_path, "headers": headers,
             "query_string": b""}
    size = max(1, len(body) // chunks + 1)
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # a client that has sent everything and stays: no more messages, ever

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = sent[0]["status"]
    return status, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


COMPLETION = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}).encode()
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_well_formed_generation_bodies_skip_fastapi():
    inner, server = Inner(), FakeServer()
    app = GenerationFastPath(inner, server)
    assert call(app, "/v1/completions", COMPLETION, chunks=3) == (200, {"ok": "CompletionRequest"})
    assert call(app, "/v1/chat/completions", CHAT) == (200, {"ok": "ChatCompletionRequest"})
    assert call(app, "/v1/completions", COMPLETION, content_type=b"Application/JSON; charset=utf-8")[0] == 200
    assert call(app, "/v1/completions", COMPLETION, root_path="/app")[0] == 200  # Ray Serve's route prefix
    assert inner.seen == []
    assert isinstance(server.bodies[0], CompletionRequest) and server.bodies[0].max_tokens == 3
    assert isinstance(server.bodies[1], ChatCompletionRequest)


def test_everything_else_reaches_fastapi_with_its_body():
    inner, server = Inner(), FakeServer()
    app = GenerationFastPath(inner, server)
    invalid = json.dumps({"model": "m", "prompt": "hi", "max_tokens": "many"}).encode()
    assert call(app, "/v1/completions", invalid, chunks=2) == (200, {"ok": "fastapi"})
    assert call(app, "/v1/completions", b"{not json") == (200, {"ok": "fastapi"})
    assert call(app, "/v1/completions", COMPLETION, content_type=b"text/plain") == (200, {"ok": "fastapi"})
    assert call(app, "/v1/completions", COMPLETION, content_type=None) == (200, {"ok": "fastapi"})
    assert call(app, "/v1/models", method="GET") == (200, {"ok": "fastapi"})
    assert call(app, "/v1/embeddings", COMPLETION) == (200, {"ok": "fastapi"})
    assert [body for _, body in inner.seen] == [invalid, b"{not json", COMPLETION, COMPLETION, None, COMPLETION]
    assert server.bodies == []


def test_api_errors_of_the_fast_path_keep_the_openai_shape():
    server = FakeServer(APIError(429, "the engine queue is full", code="queue_full", headers={"Retry-After": "2"}))
    status, body = call(GenerationFastPath(Inner(), server), "/v1/completions", COMPLETION)
    assert status == 429
    assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error"


def test_unknown_and_refused_fields_are_left_to_fastapi_to_refuse():
    """The fast path validates with the same models, so a field FastAPI's route refuses
    (protocol.py) is never served here: FastAPI answers its 400."""
    inner, server = Inner(), FakeServer()
    app = GenerationFastPath(inner, server)
    for extra in ({"temprature": 0.5}, {"guided_decoding_backend": "outlines"}, {"echo": True}):
        body = json.dumps({"model": "m", "prompt": "hi", **extra}).encode()
        assert call(app, "/v1/completions", body) == (200, {"ok": "fastapi"}), extra
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}).encode()
    assert call(app, "/v1/chat/completions", chat) == (200, {"ok": "fastapi"})
    assert server.bodies == [] and len(inner.seen) == 4
