"""The Router replica's own lean HTTP server for HAProxy's POST /internal/route.

Serve answers a replica's port with uvicorn plus its per-request wrapper (request-id and
proxy-header middlewares, ingress metrics, the ongoing-request count); at a burst's
decisions, queued one after another in the Router, that is most of each decision's CPU
(roseray's own code was ~14%). HAProxy's Lua needs much less: one request per connection,
`HTTP/1.0` with `Connection: close`, read to EOF. So once the controller lists the Router
replica's port (`wiring.own_http_port(..., router=True)`), `LeanRouterServer` duplicates Serve's listening
socket, serves the duplicate with `RouteProtocol` on the replica's event loop (the same loop
as the DeploymentHandle's router: ROUTER_ACTOR_OPTIONS in app.py) and closes Serve's server
(`wiring.close_serve_listener`). Both call the same `RouterEndpoint.respond`. If any step
before the close fails, Serve's server keeps the port (a warning in the replica's log).

The protocol: one request per connection; the request line and headers (at most
MAX_HEAD_BYTES, else 400), Content-Length bytes of body (at most `max_body`, else 413; no
chunked bodies), then `HTTP/1.1 <status>` with Content-Type, Content-Length and
`Connection: close`, and the connection is closed. A connection that has not sent a whole
request within READ_TIMEOUT_S is closed. GET /-/healthz answers what Serve's wrapper would
(wiring.serve_replica_health: "DRAINING" once the replica shuts down).

What a request here does not get: Serve's ingress metrics and request timeout, its count of
the replica's ongoing requests (the Router has no autoscaling), and access-log lines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading

from roseray.ray_serve import wiring
from roseray.ray_serve.replica_port import listening_socket_fd, wait_until_listed
from roseray.ray_serve.router_endpoint import RouterEndpoint, content_type

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024  # request line + headers (HAProxy's Lua sends ~250 bytes)
BODY_SLACK_BYTES = 64 * 1024
READ_TIMEOUT_S = 30.0
BACKLOG = 2048  # uvicorn's: a burst of HAProxy's connections waits in the accept queue
MARK_HEADER = b"x-roseray-router: lean\r\n"  # which server answered (tests, curl -i)

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed",
            413: b"Payload Too Large", 500: b"Internal Server Error", 503: b"Service Unavailable"}
_BAD_REQUEST = b'{"detail":"Bad Request"}'
_TOO_LARGE = b'{"detail":"Payload Too Large"}'
_INTERNAL = b'{"detail":"Internal Server Error"}'
_JSON = b"application/json"


def default_max_body() -> int:
    """The largest body accepted: what HAProxy forwards to the router, plus slack."""
    return wiring.ROUTER_BUFSIZE + BODY_SLACK_BYTES


def encode_response(status: int, body: bytes, kind: bytes = _JSON) -> bytes:
    return (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n%s\r\n"
            % (status, _REASONS.get(status, b"Unknown"), kind, len(body), MARK_HEADER)) + body


def parse_head(head: bytes) -> tuple[str, str, list[tuple[bytes, bytes]], int]:
    """(method, path without query, [(lower-case name, value)], Content-Length) of a request's
    head (up to, not including, the blank line). ValueError: not a request this server takes."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[1].startswith(b"/"):
        raise ValueError("bad request line")
    headers = []
    length = None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or b" " in name:
            raise ValueError("bad header line")
        name, value = name.lower(), value.strip()
        if name == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise ValueError("bad Content-Length")
            length = int(value)
        elif name == b"transfer-encoding":
            raise ValueError("chunked bodies are not taken")
        headers.append((name, value))
    return parts[0].decode("latin-1"), parts[1].partition(b"?")[0].decode("latin-1"), headers, length or 0


class RouteProtocol(asyncio.Protocol):
    """One connection: one request, answered by `endpoint.respond`, then closed."""

    __slots__ = ("endpoint", "max_body", "transport", "buffer", "need", "request", "timer", "task")

    def __init__(self, endpoint: RouterEndpoint, max_body: int) -> None:
        self.endpoint = endpoint
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.need = -1  # body bytes expected; -1 until the head has arrived
        self.request: tuple[str, str, list] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.timer = asyncio.get_running_loop().call_later(READ_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self.task is not None or self.transport.is_closing():
            return  # one request per connection: anything after it is ignored
        self.buffer += data
        if self.need < 0:
            end = self.buffer.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self._reply(400, _BAD_REQUEST)
                return
            try:
                method, path, headers, length = parse_head(bytes(self.buffer[:end]))
            except ValueError:
                self._reply(400, _BAD_REQUEST)
                return
            if length > self.max_body:
                self._reply(413, _TOO_LARGE)
                return
            del self.buffer[:end + 4]
            self.request, self.need = (method, path, headers), length
        if len(self.buffer) >= self.need:
            body = bytes(self.buffer[:self.need])
            self.buffer = bytearray()
            self.timer.cancel()
            self.task = asyncio.get_running_loop().create_task(self._answer(*self.request, body))

    def eof_received(self) -> bool:
        # a client that half-closes after its whole request still gets the answer; one that
        # went away before sending it all is done with (the transport closes)
        return self.task is not None

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()

    async def _answer(self, method: str, path: str, headers: list, body: bytes) -> None:
        try:
            status, answer = await self.endpoint.respond(method, path, headers, body)
            kind = content_type(path)
        except Exception:  # noqa: BLE001 - one request's bug is its 500, not the server's end
            logger.exception("/internal/route: error answering %s %s", method, path)
            status, answer, kind = 500, _INTERNAL, _JSON
        self._reply(status, answer, kind)

    def _reply(self, status: int, body: bytes, kind: bytes = _JSON) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.transport.is_closing():
            self.transport.write(encode_response(status, body, kind))
            self.transport.close()  # after the write is flushed


class LeanRouterServer:
    """Takes the Router replica's port over from Serve's server (see the module docstring).
    Create and `start()` it on the replica's event loop (its constructor runs there)."""

    def __init__(self, endpoint: RouterEndpoint, app_name: str, max_body: int | None = None) -> None:
        self.endpoint = endpoint
        self.app_name = app_name
        self.max_body = default_max_body() if max_body is None else max_body
        self.loop = asyncio.get_running_loop()
        self.server: asyncio.AbstractServer | None = None
        self.port: int | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._take_over_when_listed, name="roseray-lean-router", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting (the app's lifespan shutdown, on the replica's loop)."""
        self._stopping = True
        if self.server is not None:
            self.server.close()

    def _take_over_when_listed(self) -> None:
        try:
            port = wait_until_listed(lambda: wiring.own_http_port(self.app_name, router=True), lambda: self._stopping)
            if port is None:
                return
            health = wiring.serve_replica_health()
            if health is None:
                raise RuntimeError("Serve's replica (its health check) was not found")
            sock = socket.socket(fileno=os.dup(listening_socket_fd(port)))
            try:
                asyncio.run_coroutine_threadsafe(self._serve(sock, port, health), self.loop).result()
            except BaseException:
                sock.close()
                raise
            logger.info("the lean /internal/route server took this Router replica's port %d over", port)
        except Exception as error:  # noqa: BLE001 - Serve's server keeps the port
            logger.warning("the lean /internal/route server did not start; Serve's server keeps answering "
                           "this Router replica: %r", error)

    async def _serve(self, sock: socket.socket, port: int, health) -> None:
        if self._stopping:
            raise RuntimeError("the replica is stopping")
        # the server is created in this same step of the loop as the scan that finds Serve's; Serve's
        # closes after it (close_serve_listener schedules that on this loop): the socket never lacks an acceptor
        if not wiring.close_serve_listener(port):
            raise RuntimeError(f"Serve's server on port {port} was not found")
        self.endpoint.health = health
        self.server = await self.loop.create_server(lambda: RouteProtocol(self.endpoint, self.max_body),
                                                    sock=sock, backlog=BACKLOG)
        self.port = port
