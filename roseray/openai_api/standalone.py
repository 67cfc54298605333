"""`roseray serve`: the OpenAI app over one in-process engine, on uvicorn, without Ray.

Shutdown (SIGTERM, SIGINT) drains before uvicorn closes anything: the port stays open,
/ready and every new generation request answer 503 + Retry-After (a load balancer moves
on), running requests get `drain_timeout_s` to finish, and those still running then end
with an error event (streams) or a 503. Only then does uvicorn stop listening and exit.
A second SIGINT skips the rest of the drain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp

from roseray.config import EngineConfig, ServerConfig
from roseray.openai_api.api import RequestGuard, create_app
from roseray.openai_api.listen import bind_socket
from roseray.openai_api.metrics_share import MetricsShare
from roseray.runtime.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown first drains the engine (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, drain_timeout_s: float,
                 on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.on_started = on_started  # called once the engine runs and the sockets accept

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.on_started is not None and not self.should_exit:
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        logger.info("draining: new requests get 503; running ones have %.0f s to finish", self.drain_timeout_s)
        drain = asyncio.ensure_future(self.engine.drain(self.drain_timeout_s))
        while not drain.done() and not self.force_exit:
            await asyncio.sleep(0.05)
        if not drain.done():  # a second Ctrl-C
            drain.cancel()
        await super().shutdown(sockets)


def build_server(engine: AsyncLLMEngine, config: ServerConfig, *, replica_name: str | None = None,
                 replica_suffix: str = "", metrics_share: MetricsShare | None = None,
                 request_guard: RequestGuard | None = None, wrap_app: Callable[[ASGIApp], ASGIApp] | None = None,
                 on_started: Callable[[], None] | None = None) -> DrainingServer:
    """The uvicorn server of `roseray serve` over an engine that is not started yet, with the
    settings of `config`. The rest is who this process is: `replica_suffix` and `metrics_share`
    for one of several API processes (api_worker.py); `replica_name`, `request_guard`,
    `wrap_app`, `on_started` for an API process of a Ray Serve engine replica
    (ray_serve/replica_api_worker.py): its name, its ticket check, the probes Serve answers,
    and how it tells the replica that it serves."""
    replica_name = replica_name or f"standalone@{socket.gethostname()}:{config.port}{replica_suffix}"
    app = create_app(engine, config, replica_name=replica_name, request_guard=request_guard,
                     metrics_share=metrics_share)
    if wrap_app is not None:
        app = wrap_app(app)
    if config.host not in LOOPBACK_HOSTS and not config.api_key:
        logger.warning("serving on %s without an API key: anyone who reaches this address can use the model",
                       config.host)
    # the drain happens before uvicorn's own graceful shutdown, which then only closes finished connections
    uvicorn_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                    timeout_graceful_shutdown=5, lifespan="on")
    return DrainingServer(uvicorn_config, engine, config.drain_timeout_s, on_started)


def run_standalone(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Bind the port (a taken one fails before the model loads), load the model, then serve
    until SIGINT/SIGTERM, draining on the way out."""
    sock = bind_socket(config.host, config.port)
    try:
        config = dataclasses.replace(config, port=sock.getsockname()[1])  # port 0: the one the kernel picked
        engine = AsyncLLMEngine.from_engine_config(engine_config, stuck_after_s=config.stuck_after_s)
        build_server(engine, config).run(sockets=[sock])
    finally:
        sock.close()
