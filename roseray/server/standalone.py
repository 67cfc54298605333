"""`roseray serve`: the OpenAI app over one in-process engine, on uvicorn, without Ray."""

from __future__ import annotations

import logging
import socket

import uvicorn

from roseray.config import EngineConfig
from roseray.engine.async_engine import AsyncLLMEngine
from roseray.server.api import create_app

logger = logging.getLogger(__name__)


def run_standalone(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
                   api_key: str | None = None, served_model_name: str | None = None, log_prompts: bool = False,
                   log_requests: bool = False, drain_timeout_s: float = 30.0, log_level: str = "info") -> None:
    """Load the model, then serve until SIGINT/SIGTERM. On shutdown uvicorn stops accepting,
    and running requests get `drain_timeout_s` to finish before they are aborted."""
    engine = AsyncLLMEngine.from_engine_config(engine_config)
    llm = engine.engine
    app = create_app(engine, llm.tokenizer, model_name=served_model_name or llm.model_name,
                     max_model_len=llm.max_model_len, replica_name=f"standalone@{socket.gethostname()}:{port}",
                     api_key=api_key, drain_timeout_s=drain_timeout_s, log_requests=log_requests,
                     log_prompts=log_prompts)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning("serving on %s without an API key: anyone who reaches this address can use the model", host)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s,
                            lifespan="on")
    uvicorn.Server(config).run()
