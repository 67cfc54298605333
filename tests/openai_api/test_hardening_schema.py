"""Property test of the HTTP API against its own OpenAPI schema (issue 6).

schemathesis generates positive and negative cases from `app.openapi()` for every route
(about 1,500 requests: bodies of every shape the schema allows and many it does not,
odd paths, unsupported methods) and sends them in-process (ASGI) to the standalone app
over a real random:tiny engine. Every response must be a non-5xx, documented status with
a body (and every SSE event of a stream) that matches the schema, and data the schema
calls invalid must be refused. Afterwards the engine's KV accounting is intact and a
normal request is served.

Generation is derandomized (the same cases on every run) so that CI time is stable; a
failure prints a curl command that reproduces it.
"""

import asyncio
import collections
import contextlib
import json
from types import SimpleNamespace

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install schemathesis)")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from roseray.config import EngineConfig, ServerConfig  # noqa: E402
from roseray.openai_api import responses  # noqa: E402
from roseray.openai_api.api import create_app  # noqa: E402
from roseray.runtime.async_engine import AsyncEngineStats, AsyncLLMEngine  # noqa: E402

MODEL = "random:tiny"
MAX_MODEL_LEN = 64  # every generated request is short, so hundreds of them take seconds on CPU
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection]
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


class Target:
    """The app under test, without its lifespan (the test owns the engine loop; schemathesis
    would otherwise start and stop it per operation), counting requests and statuses."""

    def __init__(self) -> None:
        self.engine = AsyncLLMEngine.from_engine_config(
            EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                         max_waiting_requests=64), heartbeat_s=0.2)
        self.app = create_app(self.engine, ServerConfig(drain_timeout_s=1.0))
        self.requests = collections.Counter()
        self.statuses = collections.Counter()
        self.fields = collections.Counter()  # top-level fields of the generation bodies sent
        self.served_fields = collections.Counter()  # of those that were answered with a 200

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        self.requests[scope["method"], scope["path"]] += 1
        body = bytearray()

        async def reading_receive():
            message = await receive()
            body.extend(message.get("body", b""))
            return message

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.statuses[message["status"]] += 1
                if scope["path"].endswith("completions"):
                    with contextlib.suppress(ValueError):
                        fields = json.loads(body)
                        names = list(fields) if isinstance(fields, dict) else []
                        self.fields.update(names)
                        if message["status"] == 200:
                            self.served_fields.update(names)
            await send(message)

        await self.app(scope, reading_receive, counting_send)


class LazyTarget:
    """The ASGI app schemathesis calls; the real one is made by the `target` fixture (the
    schema is needed when the module is collected, the engine only when a test runs)."""

    target: Target | None = None

    async def __call__(self, scope, receive, send) -> None:
        assert self.target is not None, "the target fixture did not run"
        await self.target(scope, receive, send)


LAZY = LazyTarget()
# the routes, not the engine, make the schema: an app over a stand-in engine is enough to read it
STAND_IN = SimpleNamespace(stats=AsyncEngineStats(), client=SimpleNamespace(
    tokenizer=None, model_name=MODEL, max_model_len=MAX_MODEL_LEN, config=EngineConfig(model=MODEL)))
schema = schemathesis.openapi.from_dict(create_app(STAND_IN, ServerConfig()).openapi())
schema.app = LAZY


@pytest.fixture(scope="module")
def target():
    LAZY.target = Target()
    LAZY.target.engine.start()
    yield LAZY.target
    LAZY.target.engine.stop()
    LAZY.target = None


@schema.parametrize()
@SETTINGS
def test_every_route_keeps_to_its_schema(case, target):
    case.call_and_validate(checks=CHECKS)


def test_after_the_fuzzing_the_engine_is_intact_and_serves(target):
    total = sum(target.requests.values())
    generation = sum(n for (method, path), n in target.requests.items()
                     if method == "POST" and path.endswith("completions"))
    assert total >= 500 and generation >= 300, target.requests  # a few hundred cases, most of them generation
    assert target.statuses[200] >= 50 and target.statuses[400] >= 200, target.statuses  # both kinds were sent
    assert not any(status >= 500 for status in target.statuses), target.statuses
    # the agent API's fields were among the requests (most generated specs do not compile: 400s)
    agent_fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                    "guided_grammar", "structural_tag", "tools", "tool_choice", "chat_template_kwargs")
    assert all(target.fields[name] >= 5 for name in agent_fields), target.fields
    assert sum(target.served_fields[name] for name in agent_fields) >= 10, target.served_fields

    counts = asyncio.run(target.engine.check_integrity())  # on the engine's own thread, between steps
    assert counts["num_free_blocks"] == counts["num_total_blocks"] and counts["num_running"] == 0
    case = schema["/v1/completions"]["POST"].Case(
        body={"model": MODEL, "prompt": "after the storm", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    response = case.call_and_validate(checks=CHECKS)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5


def test_the_checks_catch_a_chunk_off_its_schema(target, monkeypatch):
    """The schema check of SSE events can fail: a chunk with a field the schema forbids."""
    real_chunk = responses.ResponseBuilder._chunk
    monkeypatch.setattr(responses.ResponseBuilder, "_chunk",
                        lambda self, *args: {**real_chunk(self, *args), "surprise": 1})
    case = schema["/v1/completions"]["POST"].Case(
        body={"prompt": "x", "max_tokens": 2, "stream": True, "ignore_eos": True})
    with pytest.raises(FailureGroup, match="SSE event violates schema"):
        case.call_and_validate(checks=CHECKS)
