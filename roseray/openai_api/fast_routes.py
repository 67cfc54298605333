"""The two generation routes without FastAPI's per-request machinery.

POST /v1/completions and /v1/chat/completions are nearly all of a server's requests, and
FastAPI's routing, dependency solving, `json.loads` and validation of the parsed object
are about half of a request's server CPU before the engine sees it; when many requests
arrive together that CPU is their time to first token. This pure ASGI layer, innermost of
roseray's middleware (so the API key, the body limit and the replica header still apply),
answers a well-formed JSON body of those routes itself: pydantic validates the raw bytes
(`model_validate_json`) and the same `OpenAIServer.generate` runs. Anything else (another
route or method, another content type, a body that does not parse or validate, an
unknown or refused field included) goes to FastAPI unchanged with its body replayed, so
every error keeps its one implementation (errors.py) and the routes stay in the OpenAPI
schema.
"""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel

from roseray.openai_api.body_limit import replay_receive
from roseray.openai_api.errors import APIError, error_response
from roseray.openai_api.protocol import ChatCompletionRequest, CompletionRequest

_ROUTES: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                       "/v1/chat/completions": ChatCompletionRequest}


class GenerationFastPath:
    def __init__(self, app, server) -> None:
        self.app = app
        self.server = server  # roseray.openai_api.api.OpenAIServer

    async def __call__(self, scope, receive, send) -> None:
        model = _ROUTES.get(_route_path(scope)) if scope["type"] == "http" and scope["method"] == "POST" else None
        if model is None or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        messages = [await receive()]
        while messages[-1]["type"] == "http.request" and messages[-1].get("more_body", False):
            messages.append(await receive())
        if messages[-1]["type"] != "http.request":  # the client left while sending its body
            await self.app(scope, replay_receive(messages, receive), send)
            return
        try:
            body = model.model_validate_json(b"".join(m.get("body", b"") for m in messages))
        except ValueError:  # not JSON, or invalid: FastAPI answers with the usual 400
            await self.app(scope, replay_receive(messages, receive), send)
            return
        try:
            response = await self.server.generate(Request(scope, receive), body)
        except APIError as error:
            response = error_response(error.status_code, error.message, param=error.param, code=error.code,
                                      headers=error.headers)
        await response(scope, receive, send)


def _route_path(scope) -> str:
    """The path below the app's root_path (Ray Serve mounts apps under one)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _is_json(scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False
