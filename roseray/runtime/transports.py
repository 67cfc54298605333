"""The one place that decides where the engine runs: make_engine_client."""

from __future__ import annotations

from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.runtime.engine_client import EngineClient
from roseray.runtime.in_process_client import InProcessEngineClient
from roseray.runtime.process_client import EngineProcessClient


def make_engine_client(config: EngineConfig, *, pipe_fds: tuple[int, int] | None = None) -> EngineClient:
    """Load the model behind an EngineClient: over `pipe_fds` (the command pipe's write end,
    the output pipe's read end) to an engine process that another process started for
    several clients; else in a child process of its own with `config.engine_process` (the
    default on CUDA); else on a thread of this process."""
    if pipe_fds is not None:
        return EngineProcessClient(config, pipe_fds=pipe_fds)
    if config.resolve_engine_process():
        return EngineProcessClient(config)
    return InProcessEngineClient(LLMEngine(config))
