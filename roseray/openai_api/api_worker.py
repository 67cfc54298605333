"""One API process of `roseray serve --api-processes N`, started by api_processes.py.

It serves the same app as `roseray serve` (create_app on a DrainingServer) over a
listening socket the supervisor bound, with an AsyncLLMEngine over an
engine client that speaks over this process's pipe pair to the one shared engine
child. Its settings (APIProcessSettings: the engine's and the server's configs) come as JSON
through a pipe, which keeps the API key out of the command line. SIGTERM/SIGINT drain its requests as in `roseray
serve`; if the supervisor dies (the lifeline pipe ends), it stops the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading

from roseray.config import EngineConfig
from roseray.openai_api.api_processes import APIProcessSettings
from roseray.openai_api.metrics_share import MetricsShare
from roseray.openai_api.standalone import build_server
from roseray.runtime.async_engine import AsyncLLMEngine
from roseray.runtime.engine_loop import IDLE_STATS_INTERVAL_S

EXIT_INTERRUPTED = 130  # 128 + SIGINT


def read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def stop_when_parent_dies(lifeline_fd: int) -> None:
    """The parent (supervisor, or the Ray replica) holds the lifeline's write end: reading
    its end means it is gone; then SIGTERM this process (it drains)."""
    def watch() -> None:
        os.read(lifeline_fd, 1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="roseray-lifeline", daemon=True).start()


def connect_async_engine(config: EngineConfig, commands_fd: int, outputs_fd: int, **kwargs) -> AsyncLLMEngine:
    """The AsyncLLMEngine (not started) of one client of a shared engine child (its pipe pair).
    Every client checks the engine-wide queue (in the engine's stats) against the whole limit,
    and an idle loop wakes as often as the engine sends an idle client its stats (a scrape
    then sees them)."""
    # waits until the model is loaded
    return AsyncLLMEngine.from_engine_config(config, pipe_fds=(commands_fd, outputs_fd),
                                             heartbeat_s=IDLE_STATS_INTERVAL_S, **kwargs)


def worker_parser(description: str) -> argparse.ArgumentParser:
    """The arguments api_processes.spawn_api_worker gives an API process."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--index", type=int, required=True,
                        help="which API process (roseray serve: 0..N-1; a Ray replica: 1..N, its own app is 0)")
    parser.add_argument("--socket-fd", type=int, required=True, help="the listening socket")
    parser.add_argument("--commands-fd", type=int, required=True, help="the engine's command pipe (write end)")
    parser.add_argument("--outputs-fd", type=int, required=True, help="the engine's output pipe (read end)")
    parser.add_argument("--settings-fd", type=int, required=True,
                        help="a pipe holding the settings (APIProcessSettings as JSON)")
    parser.add_argument("--lifeline-fd", type=int, required=True, help="ends when the parent process is gone")
    parser.add_argument("--metrics-dir", required=True, help="where the API processes share request metrics")
    parser.add_argument("--ready-fd", type=int, default=None, help="a pipe: one byte once this process serves")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = worker_parser("one API process of `roseray serve --api-processes N`").parse_args(argv)
    settings = APIProcessSettings.decode(read_all(args.settings_fd))
    name = f"api{args.index}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s")
    stop_when_parent_dies(args.lifeline_fd)
    engine = connect_async_engine(settings.engine, args.commands_fd, args.outputs_fd,
                                  stuck_after_s=settings.server.stuck_after_s)
    sock = socket.socket(fileno=args.socket_fd)
    server = build_server(engine, settings.server, replica_suffix=f"/{name}",
                          metrics_share=MetricsShare(args.metrics_dir, args.index))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # the supervisor forwarded a Ctrl-C: drained; uvicorn raises it once done
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
