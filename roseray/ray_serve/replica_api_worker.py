"""One API process of a Ray Serve engine replica, started by replica_api_processes.py.

It serves the replica's OpenAI app (create_app, with the Router's ticket check) on the
listening socket of the replica's own HTTP server, which the replica passed to it, over an
EngineProcessClient on its own pipe pair to the replica's engine child; once it serves, it
says so on its ready pipe. Serve's wrapper answers HAProxy's health check (/-/healthz) on
that port before the app sees a request; a connection this process accepts never meets
that wrapper, so `ServeProbes` answers it the same way. Its settings (APIProcessSettings) come
as JSON through a pipe (the API key and the ticket secret stay off the command line). SIGTERM
drains as in `roseray serve`; when the replica's process ends, the lifeline pipe ends and this
process drains and stops too.
"""

from __future__ import annotations

import logging
import os
import socket

from roseray.openai_api.api_processes import APIProcessSettings
from roseray.openai_api.api_worker import connect_async_engine, read_all, stop_when_parent_dies, worker_parser
from roseray.openai_api.metrics_share import MetricsShare
from roseray.openai_api.standalone import build_server
from roseray.ray_serve import wiring
from roseray.ray_serve.ticket import TicketSigner
from roseray.runtime.async_engine import AsyncLLMEngine, LoopState


class ServeProbes:
    """Answers HAProxy's health check, GET /-/healthz, as Serve's replica wrapper does: 200
    "success" while the engine serves, 503 "DRAINING" once it drains, 503 "UNHEALTHY" when
    its loop is dead or stuck. Everything else goes to the app."""

    def __init__(self, app, engine: AsyncLLMEngine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == wiring.HEALTHZ_PATH:
            await self._health(send)
        else:
            await self.app(scope, receive, send)

    async def _health(self, send) -> None:
        if self.engine.state in (LoopState.DRAINING, LoopState.STOPPED):
            status, body = 503, b"DRAINING"
        elif not self.engine.is_ready:
            status, body = 503, b"UNHEALTHY"
        else:
            status, body = 200, wiring.HEALTHY_MESSAGE.encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> int:
    args = worker_parser("one API process of a roseray engine replica on Ray Serve").parse_args(argv)
    if args.ready_fd is None:
        raise SystemExit("--ready-fd is required: the replica waits for it")
    settings = APIProcessSettings.decode(read_all(args.settings_fd))
    if settings.replica_name is None or settings.ticket_secret is None:
        raise SystemExit("the settings name no replica or ticket secret: the replica sets both")
    replica_name = f"{settings.replica_name}/api{args.index}"
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s {replica_name} %(name)s: %(message)s")
    stop_when_parent_dies(args.lifeline_fd)
    engine = connect_async_engine(settings.engine, args.commands_fd, args.outputs_fd,
                                  stuck_after_s=settings.server.stuck_after_s)
    tickets = TicketSigner(settings.ticket_secret)  # the Router's signature, as on the replica's own server

    def say_ready() -> None:
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)

    sock = socket.socket(fileno=args.socket_fd)
    build_server(engine, settings.server, replica_name=replica_name, request_guard=tickets.check_request,
                 metrics_share=MetricsShare(args.metrics_dir, args.index),
                 wrap_app=lambda app: ServeProbes(app, engine), on_started=say_ready).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
