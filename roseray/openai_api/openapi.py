"""The OpenAPI schema of the app: what each route answers, errors included.

Responses are built as plain dicts on the hot path (responses.py); the models here only
describe them, for the schema (and for the schemathesis test that holds the app to it).
FastAPI documents a 422 for every route with a body; roseray answers 400 instead, so
the schema is post-processed to say so. It is OpenAPI 3.2: a streamed response's SSE
events are described with 3.2's `itemSchema`.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

# roseray.engine.request.FINISH_REASONS, and "tool_calls" when a chat output made tool calls
FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null when the output is only tool calls (or only reasoning)
    tool_calls: list[ToolCall] | None = None
    # with the server's reasoning parser: the reasoning (vLLM's two names for it), unless include_reasoning is false
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason | None


class CompletionChunk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None  # present (null until the last chunk) with stream_options.include_usage


class CalledFunctionDelta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None  # on a call's first delta only
    arguments: str | None = None  # a piece of the arguments text


class ToolCallDelta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int
    id: str | None = None  # id and type on a call's first delta only
    type: Literal["function"] | None = None
    function: CalledFunctionDelta


class ChatDelta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Status(BaseModel):
    status: str


def inline_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with its `$defs` inlined (it is embedded where `#/$defs` would
    not resolve: inside an SSE event's `contentSchema`)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.rsplit("/", 1)[1]])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(value) for value in node]
        return node

    return resolve(schema)


def sse_item_schema(chunk: type[BaseModel]) -> dict:
    """One SSE event of a streamed response (OpenAPI 3.2 `itemSchema`): its data is a chunk,
    an error (the engine failed, or the server drains), or the final `[DONE]`."""
    payload = {"anyOf": [inline_schema(chunk), inline_schema(ErrorResponse)]}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"type": "string", "if": {"const": "[DONE]"},
                                    "else": {"contentMediaType": "application/json", "contentSchema": payload}}}}


OPENAPI_VERSION = "3.2.0"
_ERROR = {"model": ErrorResponse}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}

GENERATION_RESPONSES: dict[int | str, dict] = {
    400: {**_ERROR, "description": "invalid request"},
    401: {**_ERROR, "description": "missing or wrong API key (when one is configured)"},
    404: {**_ERROR, "description": "unknown model"},
    413: {**_ERROR, "description": "request body over the size limit"},
    429: {**_ERROR, "description": "the engine queue is full", "headers": _RETRY_AFTER},
    500: {**_ERROR, "description": "the engine failed while generating this request"},
    503: {**_ERROR, "description": "not ready, draining, or not routed", "headers": _RETRY_AFTER},
}


def completion_responses(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict]:
    stream = {"text/event-stream": {"itemSchema": sse_item_schema(chunk)}}
    return {200: {"model": model, "description": "the whole response, or an SSE stream when `stream` is true",
                  "content": stream}, **GENERATION_RESPONSES}


READ_RESPONSES: dict[int | str, dict] = {
    401: {**_ERROR, "description": "missing or wrong API key (when one is configured)"},
    404: {**_ERROR, "description": "not found"},
}
PROBE_RESPONSES: dict[int | str, dict] = {503: {**_ERROR, "description": "unhealthy or not ready"}}


def install_openapi(app: FastAPI) -> None:
    """`app.openapi()` (served at the app's openapi_url) states 400, not FastAPI's 422, for
    invalid bodies."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, openapi_version=OPENAPI_VERSION,
                                 routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
