"""The OpenAI HTTP API of one engine replica (FastAPI), the same app in Ray and standalone.

POST /v1/completions, /v1/chat/completions (SSE streaming or whole), GET /v1/models,
/health (liveness), /ready, /metrics, and (unless turned off) /openapi.json and /docs.
Each streamed request costs one SSE write per engine step. A client that goes away closes
its RequestStream, which aborts the request in the engine (counted as "abort"). Prompt
text is never logged unless `log_prompts` is set.

Around the routes, outermost first: the replica header on every response; CORS (only
when origins are configured: a browser on another origin gets nothing otherwise); the
API key (before any body is read); the body size limit (413); the generation fast path
(fast_routes.py: a well-formed completion or chat body skips FastAPI's request machinery).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from roseray.config import ServerConfig
from roseray.engine.outputs import RequestDelta
from roseray.openai_api.auth import ApiKeyMiddleware
from roseray.openai_api.body_limit import BodyLimitMiddleware
from roseray.openai_api.chat_output import ChatOutput
from roseray.openai_api.constraints import Constraint
from roseray.openai_api.errors import APIError, error_body, install_error_handlers, param_of
from roseray.openai_api.fast_routes import GenerationFastPath
from roseray.openai_api.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from roseray.openai_api.metrics_share import MetricsShare
from roseray.openai_api.openapi import (
    PROBE_RESPONSES,
    READ_RESPONSES,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ModelCard,
    ModelList,
    Status,
    completion_responses,
    install_openapi,
)
from roseray.openai_api.prompt_ids import prompt_ids
from roseray.openai_api.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedFieldError
from roseray.openai_api.responses import SSE_DONE, ResponseBuilder, TokenText, sse_event
from roseray.openai_api.sse_writer import EngineSSEResponse, until_disconnect
from roseray.openai_api.tools import NO_TOOLS, ToolPlan
from roseray.runtime.async_engine import AsyncLLMEngine, EngineUnavailableError, QueueFullError, RequestStream
from roseray.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# FastAPI 0.16x asks OpenTelemetry's three global providers whether to trace, on every request
# (a visible share of admitting a streamed request in a profile); roseray's metrics are its own
# Prometheus ones. Older FastAPI has no such option.
NO_FASTAPI_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                        if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})

REPLICA_HEADER = "x-roseray-replica"
RETRY_AFTER_UNAVAILABLE_S = 1  # a draining or starting replica: another replica (or this one, soon) will answer
ENGINE_ERROR_MESSAGE = "the engine failed while generating this request"
_PARAM_NAMES = (frozenset(f for f in SamplingParams.__dataclass_fields__)
                | {"prompt", "messages", "tools", "tool_choice", "chat_template_kwargs"})

# Checks a request before it may generate; returns why it is refused (503 + Retry-After:
# in roseray's Ray app the only unticketed requests that are not attacks come from HAProxy
# while it has not learnt the router yet, and those are worth retrying), or None.
RequestGuard = Callable[[Request], "str | None"]


class ReplicaHeaderMiddleware:
    """Adds `x-roseray-replica: <name>` to every response (errors included)."""

    def __init__(self, app, replica_name: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_name.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


class Prepared(NamedTuple):
    """A request ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    plan: ToolPlan  # what becomes of a chat request's tools
    constraint: Constraint | None  # the output's constraint and the field that asked for it
    prompt_text: str | None  # a chat request's rendered prompt


class OpenAIServer:
    """The route handlers; holds the engine, tokenizer and metrics of this replica."""

    def __init__(self, engine: AsyncLLMEngine, tokenizer, *, model_name: str, max_model_len: int | None,
                 request_guard: RequestGuard | None = None, log_requests: bool = False,
                 log_prompts: bool = False, max_logprobs: int | None = None,
                 metrics_share: MetricsShare | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs  # the engine's max_logprobs (SamplingParams caps at MAX_LOGPROBS)
        self.request_guard = request_guard
        self.log_requests = log_requests
        self.log_prompts = log_prompts  # off by default: prompts are user data
        self.tool_call_parser = tool_call_parser  # ServerConfig's: what `tool_choice: auto` parses with
        self.reasoning_parser = reasoning_parser  # the engine's: how the model marks its reasoning
        self.metrics = ServerMetrics(model_name, lambda: engine.stats, share=metrics_share)
        if isinstance(engine, AsyncLLMEngine):  # not a stand-in of a test
            engine.client.on_message_delay = self.metrics.message_delay.observe
        # request ids: a random prefix of this process and a counter (a getrandom call per id,
        # as uuid4 or secrets make, was ~3% of admitting a request in a py-spy profile)
        self._id_prefix, self._id_numbers = secrets.token_hex(8), itertools.count()
        self.token_text = TokenText(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        self.created = int(time.time())

    # ---- probes and listings --------------------------------------------------------------------
    async def health(self) -> Response:
        try:
            self.engine.check_health()
        except RuntimeError as error:
            return JSONResponse(error_body(503, str(error), code="engine_unhealthy"), status_code=503)
        return JSONResponse({"status": "ok"})

    async def ready(self) -> Response:
        if not self.engine.is_ready:
            state = self.engine.state.value
            return JSONResponse(error_body(503, f"not ready ({state})", code=state), status_code=503)
        return JSONResponse({"status": "ready"})

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "roseray",
                "root": self.model_name, "max_model_len": self.max_model_len}

    async def model(self, model_id: str) -> dict:
        self._check_model(model_id)
        return self._model_card()

    # ---- generation -------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    def _prepare(self, body: CompletionRequest | ChatCompletionRequest) -> Prepared:
        """Validate the body and tokenize its prompt; every failure is a 400."""
        try:
            if isinstance(body, ChatCompletionRequest):
                params, plan, constraint = body.plan(self.tool_call_parser)
            else:
                params, plan, constraint = body.to_sampling_params(), NO_TOOLS, body.constraint()
            if self.max_logprobs is not None and params.logprobs is not None and params.logprobs > self.max_logprobs:
                name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
                raise UnsupportedFieldError(name, f"{name} must be at most {self.max_logprobs} on this server, "
                                                  f"got {params.logprobs}")
            token_ids, text = prompt_ids(body, self.tokenizer)
            return Prepared(token_ids, params, plan, constraint, text)
        except UnsupportedFieldError as error:
            raise APIError(400, str(error), param=error.param) from None
        except UnicodeError:  # a lone surrogate ("\ud800") parses as JSON but is no text
            param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise APIError(400, f"{param} holds a string that is not valid Unicode (a lone surrogate escape)",
                           param=param) from None
        except ValueError as error:
            raise APIError(400, str(error), param=self._param(body, str(error))) from None

    def _chat_output(self, body, prepared: Prepared) -> ChatOutput | None:
        """How a chat response's text is shaped, when it is parsed at all (reasoning, tools)."""
        if not isinstance(body, ChatCompletionRequest) or (self.reasoning_parser is None
                                                           and not prepared.plan.parses):
            return None
        return ChatOutput(prepared.plan, self.tool_call_parser, self.reasoning_parser,
                          include_reasoning=body.include_reasoning is not False, tools=body.template_tools(),
                          prompt=prepared.prompt_text)

    def _check_length(self, body, prompt_ids: list[int]) -> None:
        """A prompt that fills max_model_len leaves no room for a token. The engine's own check
        misses it when max_tokens is unset (its default, max_model_len - prompt, goes negative),
        and such a request would overflow its block table."""
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise APIError(400, f"the prompt ({len(prompt_ids)} tokens) leaves no room for output within "
                                f"max_model_len ({self.max_model_len}): prompt + max_tokens must fit in it",
                           param=param)

    @staticmethod
    def _param(body, message: str) -> str | None:
        param = param_of(message, _PARAM_NAMES)
        if isinstance(body, ChatCompletionRequest) and param == "logprobs":
            return "top_logprobs"
        return param

    async def generate(self, http_request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        try:
            return await self._generate(http_request, body)
        except APIError:
            raise
        except Exception as error:  # answered here so the response still names its replica
            logger.exception("request failed")
            raise APIError(500, f"internal server error ({type(error).__name__})", code="internal_error") from None

    async def _generate(self, http_request: Request, body: CompletionRequest | ChatCompletionRequest) -> Response:
        if self.request_guard is not None:
            refusal = self.request_guard(http_request)
            if refusal is not None:
                raise APIError(503, refusal, code="not_routed", headers={"Retry-After": "1"})
        self._check_model(body.model)
        prepared = self._prepare(body)
        prompt_ids, params = prepared.prompt_ids, prepared.params
        self._check_length(body, prompt_ids)
        is_chat = isinstance(body, ChatCompletionRequest)
        request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{self._id_prefix}{next(self._id_numbers):08x}"
        arrival = time.monotonic()
        if self.log_prompts:
            logger.info("request %s prompt (%d tokens): %r", request_id, len(prompt_ids),
                        self.tokenizer.decode(prompt_ids))
        try:
            stream = await self.engine.add_request(request_id, prompt_ids, params, arrival_time=arrival)
        except QueueFullError as error:
            raise APIError(429, str(error), code="queue_full",
                           headers={"Retry-After": str(error.retry_after_s)}) from None
        except EngineUnavailableError as error:
            raise APIError(503, str(error), code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)}) from None
        except ValueError as error:  # a constraint the engine cannot compile names the field that asked for it
            param = self._param(body, str(error))
            if prepared.constraint is not None and param in (None, "structured_outputs"):
                param = prepared.constraint.param
            raise APIError(400, str(error), param=param) from None
        builder = ResponseBuilder("chat" if is_chat else "completion", request_id, self.model_name, self.token_text,
                                  num_top_logprobs=params.logprobs, include_usage=body.include_usage,
                                  continuous_usage=body.continuous_usage,
                                  chat_output=self._chat_output(body, prepared))
        timer = self.metrics.request_timer(arrival)
        try:
            if body.stream:
                render, render_error = self._sse_renderers(builder, timer)
                return EngineSSEResponse(stream, render, render_error, on_end=timer.on_response_end,
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return await self._whole(http_request, stream, builder, timer)
        except BaseException:
            stream.close()
            raise

    def _sse_renderers(self, builder: ResponseBuilder, timer: RequestTimer):
        """The SSE bytes of each delta of a streamed request, and of a stream that failed
        (for EngineSSEResponse, which writes them from the engine's hand-off)."""

        def render(delta: RequestDelta) -> bytes:
            timer.on_tokens(len(delta.new_token_ids), time.monotonic())
            if not delta.finished:
                return builder.delta_event(delta)
            self._finished(timer, delta)
            if delta.finish_reason == "error":
                return sse_event(error_body(500, ENGINE_ERROR_MESSAGE, code="engine_error")) + SSE_DONE
            return builder.stream_chunks((delta,)) + builder.stream_end(delta)

        def render_error(error: BaseException) -> bytes:
            timer.count("error")
            if isinstance(error, EngineUnavailableError):
                return sse_event(error_body(503, str(error), code="unavailable")) + SSE_DONE
            logger.error("stream failed", exc_info=error)
            return sse_event(error_body(500, f"internal server error ({type(error).__name__})",
                                        code="internal_error")) + SSE_DONE

        return render, render_error

    async def _whole(self, http_request: Request, stream: RequestStream, builder: ResponseBuilder,
                     timer: RequestTimer) -> Response:
        watcher = asyncio.ensure_future(_close_on_disconnect(http_request, stream))
        try:
            texts, token_ids, logprobs, last = [], [], [], None
            async for deltas in stream:
                timer.on_tokens(sum(len(d.new_token_ids) for d in deltas), time.monotonic())
                for delta in deltas:
                    texts.append(delta.new_text)
                    token_ids.extend(delta.new_token_ids)
                    if delta.new_logprobs is not None:
                        logprobs.extend(delta.new_logprobs)
                last = deltas[-1]
        except EngineUnavailableError as error:
            raise APIError(503, str(error), code="unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)}) from None
        finally:
            watcher.cancel()
        if last is None or not last.finished:  # the client went away; nobody reads this
            timer.count("abort")
            return Response(status_code=499)
        self._finished(timer, last)
        if last.finish_reason == "error":
            raise APIError(500, ENGINE_ERROR_MESSAGE, code="engine_error")
        body = builder.full_response("".join(texts), token_ids, logprobs if builder.num_top_logprobs is not None
                                     else None, last)
        return JSONResponse(body)

    def _finished(self, timer: RequestTimer, last) -> None:
        req = last.request
        now = time.monotonic()
        timer.on_finish(last.finish_reason, now, num_prompt_tokens=last.num_prompt_tokens,
                        num_output_tokens=last.num_output_tokens, arrival_time=req.arrival_time,
                        first_scheduled_time=req.first_scheduled_time)
        if self.log_requests:
            logger.info("request %s finished (%s): %d prompt + %d output tokens in %.3f s", last.request_id,
                        last.finish_reason, last.num_prompt_tokens, last.num_output_tokens, now - timer.arrival_time)


async def _close_on_disconnect(http_request: Request, stream: RequestStream) -> None:
    await until_disconnect(http_request.receive)
    stream.close()


def create_app(engine: AsyncLLMEngine, config: ServerConfig, *, replica_name: str = "standalone",
               request_guard: RequestGuard | None = None, metrics_share: MetricsShare | None = None) -> FastAPI:
    """The OpenAI app over `engine` with the settings of `config`. Its lifespan starts the
    engine loop and, on shutdown, drains it (running requests get `config.drain_timeout_s`
    to finish). The model's name (unless `config.served_model_name`), its tokenizer and
    limits are the engine's. The rest is who this process is: its `replica_name` (the
    x-roseray-replica header), its `request_guard` (the Ray app's ticket check) and its
    `metrics_share` (one of several API processes of one engine, metrics_share.py).
    `config.enable_docs`: the OpenAPI schema at /openapi.json and Swagger UI at /docs (behind the
    API key when one is set, as every route but the probes)."""
    llm = engine.client
    server = OpenAIServer(engine, llm.tokenizer, model_name=config.served_model_name or llm.model_name,
                          max_model_len=llm.max_model_len, request_guard=request_guard,
                          log_requests=config.log_requests, log_prompts=config.log_prompts,
                          max_logprobs=llm.config.max_logprobs, metrics_share=metrics_share,
                          tool_call_parser=config.tool_call_parser, reasoning_parser=llm.config.reasoning_parser)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        publisher = None
        if metrics_share is not None:
            publisher = asyncio.ensure_future(metrics_share.publish_forever(server.metrics.registry))
        yield
        await engine.shutdown(config.drain_timeout_s)
        if publisher is not None:
            publisher.cancel()  # publishes once more on the way out
            await asyncio.gather(publisher, return_exceptions=True)

    app = FastAPI(title="roseray", lifespan=lifespan, docs_url="/docs" if config.enable_docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if config.enable_docs else None, **NO_FASTAPI_TELEMETRY)
    app.state.server = server
    install_error_handlers(app)
    install_openapi(app)

    app.add_api_route("/health", server.health, methods=["GET"], response_model=Status, responses=PROBE_RESPONSES)
    app.add_api_route("/ready", server.ready, methods=["GET"], response_model=Status, responses=PROBE_RESPONSES)

    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=Response, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus metrics"},
        **READ_RESPONSES})
    app.add_api_route("/v1/models", server.models, methods=["GET"], response_model=ModelList,
                      responses=READ_RESPONSES)
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"], response_model=ModelCard,
                      responses=READ_RESPONSES)

    @app.post("/v1/completions", response_model=None, responses=completion_responses(CompletionResponse,
                                                                                              CompletionChunk))
    async def completions(http_request: Request, body: CompletionRequest) -> Response:
        return await server.generate(http_request, body)

    @app.post("/v1/chat/completions", response_model=None, responses=completion_responses(
        ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(http_request: Request, body: ChatCompletionRequest) -> Response:
        return await server.generate(http_request, body)

    # add_middleware puts each one outside the ones before it
    app.add_middleware(GenerationFastPath, server=server)  # innermost: well-formed generation requests skip FastAPI
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)  # refuses before the body is read
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-request-id", "x-session-id"],
                           expose_headers=[REPLICA_HEADER, "retry-after"], allow_credentials=False, max_age=600)
    app.add_middleware(ReplicaHeaderMiddleware, replica_name=replica_name)  # outermost: every response
    return app
