"""What the OpenAI API tests share: the app served on loopback over a real engine
(`serving`), reading SSE bodies and /metrics text, the OpenAI error shape, and waiting for
an engine to be idle."""

import contextlib
import json
import threading
import time
from types import SimpleNamespace

import httpx
import uvicorn

from roseray.config import EngineConfig, ServerConfig
from roseray.openai_api.api import create_app
from roseray.runtime.async_engine import AsyncLLMEngine
from tests.waiting import wait_until

MODEL = "random:tiny"
REPLICA = "test-replica-0"


@contextlib.contextmanager
def serving(config: EngineConfig, step_delay_s: float = 0.0, request_guard=None, **settings):
    """Serve the app on a free loopback port, with ServerConfig `settings` and `request_guard`.
    `step_delay_s` slows every engine step, so that long requests are still running when a
    test acts on them."""
    engine = AsyncLLMEngine.from_engine_config(config, heartbeat_s=0.2)
    llm = engine.client
    if step_delay_s:  # the LLMEngine on its thread (an InProcessEngineClient)
        real_step = llm.engine.step

        def slow_step():
            time.sleep(step_delay_s)  # a slow engine step: the behaviour the caller asked for
            return real_step()

        llm.engine.step = slow_step
    app = create_app(engine, ServerConfig(**{"drain_timeout_s": 1.0, **settings}), replica_name=REPLICA,
                     request_guard=request_guard)
    with uvicorn_on_loopback(app) as port:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, engine=engine, tokenizer=llm.tokenizer,
                              app=app)


@contextlib.contextmanager
def uvicorn_on_loopback(app):
    """Serve an ASGI app with uvicorn on a thread, on a free loopback port (yielded); stopped on exit."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), timeout=30, message="uvicorn started")
    assert server.started, "uvicorn did not start"
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(15)


def sse_events(text: str) -> list:
    """The JSON events of a whole SSE body, which must end with [DONE]."""
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """`response` is an error of `status` in the OpenAI shape (naming `param`, if given)."""
    assert response.status_code == status, response.text
    assert response.headers["x-roseray-replica"] == REPLICA
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def wait_until_idle(engine, timeout_s: float = 5.0):
    """Wait until the engine runs and queues nothing, every KV block is free and no stream is
    open; return its stats then."""
    total = engine.stats.num_total_blocks

    def idle():
        s = engine.stats
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == total and not engine.num_active_requests:
            return s
        return None

    return wait_until(idle, timeout=timeout_s,
                      message=lambda: f"engine still busy: {engine.stats}, {engine.num_active_requests} streams")


def metric(text: str, name: str) -> float:
    """The sum of every sample in Prometheus `text` whose line starts with `name`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
