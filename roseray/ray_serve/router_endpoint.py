"""The Router replica's HTTP app: HAProxy's POST /internal/route, as a plain ASGI callable.

HAProxy's Lua asks the Router once per request, on a new connection, and the Router's
answers are serial in its event loop, so every microsecond of the HTTP layer is paid 128
times by a burst of 128. FastAPI/Starlette build a Request, a Headers mapping, a route
match, a JSONResponse and a dependency-solving call for each; this app reads the three
headers it needs from the ASGI scope, the body from `receive`, and answers pre-encoded
JSON (the part naming a replica is encoded once per replica).

    POST /internal/route   200 wiring.route_answer JSON (replica + ticket header)
                           400 {"detail": "missing x-request-id"}
                           503 {"detail": "<why>"} when picking raised RuntimeError
    GET  /health           200 {"status": "ok"}
    GET  /metrics          200 the Router's Prometheus metrics (router_metrics.py), when given
    GET  /-/healthz        200 "success" (503 "DRAINING"/"UNHEALTHY"): HAProxy's health check,
                           answered by Serve's wrapper until the lean server takes the port over
    anything else          404 (405 for another method on a known path)
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable

from roseray.ray_serve import wiring
from roseray.ray_serve.router_metrics import RouterMetrics
from roseray.ray_serve.ticket import REQUEST_ID_HEADER, TICKET_HEADER, TicketSigner

# pick(body, session id, X-Body-Truncated) -> the chosen replica; RuntimeError: none can serve
Pick = Callable[[bytes, "str | None", "str | None"], Awaitable[wiring.ReplicaPick]]

_REQUEST_ID = REQUEST_ID_HEADER.encode()
_SESSION = wiring.SESSION_HEADER.encode()
_TRUNCATED = wiring.BODY_TRUNCATED_HEADER.encode()
_TICKET_MARK = "\x00ticket\x00"  # stands in for the ticket while an answer's frame is encoded
_MAX_CACHED_PICKS = 4096


def _json(payload: object) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


_HEALTH = _json({"status": "ok"})
_MISSING_ID = _json({"detail": f"missing {REQUEST_ID_HEADER}"})
_NOT_FOUND = _json({"detail": "Not Found"})
_NOT_ALLOWED = _json({"detail": "Method Not Allowed"})
_JSON_TYPE = b"application/json"
_TEXT_TYPE = b"text/plain; charset=utf-8"
_METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def content_type(path: str) -> bytes:
    """The content type of RouterEndpoint.respond's answer for `path`."""
    if path == wiring.HEALTHZ_PATH:
        return _TEXT_TYPE
    return _METRICS_TYPE if path == "/metrics" else _JSON_TYPE


async def _always_healthy() -> tuple[bool, str]:
    return True, wiring.HEALTHY_MESSAGE


class RouterEndpoint:
    """ASGI app of the Router replica (Serve accepts any ASGI callable from
    `__serve_build_asgi_app__`). `pick` runs the routing policy; `tickets` signs each
    request id into the answer's request_headers. `respond` is the whole of the HTTP logic,
    shared with the lean server (router_server.py) that takes the Router's port over.
    `metrics`: what GET /metrics answers (404 without)."""

    def __init__(self, pick: Pick, tickets: TicketSigner, metrics: RouterMetrics | None = None) -> None:
        self.pick = pick
        self.tickets = tickets
        self.metrics = metrics
        self._frames: dict[wiring.ReplicaPick, tuple[bytes, bytes]] = {}
        # GET /-/healthz: (healthy, message) as Serve's replica says (the lean server sets it)
        self.health: Callable[[], Awaitable[tuple[bool, str]]] = _always_healthy
        self.on_shutdown: list[Callable[[], None]] = []  # run at the app's lifespan shutdown

    async def __call__(self, scope: dict, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            body = await read_body(receive)
            status, body = await self.respond(scope["method"], scope["path"], scope["headers"], body)
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", content_type(scope["path"])),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    for callback in self.on_shutdown:
                        callback()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def respond(self, method: str, path: str, headers: Iterable[tuple[bytes, bytes]],
                      body: bytes) -> tuple[int, bytes]:
        """(status, body) of one request; `headers`: (lower-case name, value) pairs as in ASGI.
        Its content type is content_type(path)."""
        if path == wiring.ROUTE_PATH:
            return await self.route(headers, body) if method == "POST" else (405, _NOT_ALLOWED)
        if path == "/health":
            return (200, _HEALTH) if method in ("GET", "HEAD") else (405, _NOT_ALLOWED)
        if path == "/metrics" and self.metrics is not None:
            return (200, self.metrics.render()) if method in ("GET", "HEAD") else (405, _NOT_ALLOWED)
        if path == wiring.HEALTHZ_PATH:  # Serve's wrapper answers it before the app; the lean server here
            healthy, message = await self.health()
            return (200 if healthy else 503), message.encode()
        return 404, _NOT_FOUND

    async def route(self, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> tuple[int, bytes]:
        request_id = session_id = truncated = None
        for name, value in headers:  # the first of a repeated header wins
            if name == _REQUEST_ID:
                request_id = request_id if request_id is not None else value.decode("latin-1")
            elif name == _SESSION:
                session_id = session_id if session_id is not None else value.decode("latin-1")
            elif name == _TRUNCATED:
                truncated = truncated if truncated is not None else value.decode("latin-1")
        if not request_id:
            return 400, _MISSING_ID
        try:
            pick = await self.pick(body, session_id, truncated)
        except RuntimeError as error:
            return 503, _json({"detail": str(error)})
        return 200, self.answer(pick, self.tickets.sign(request_id))

    def answer(self, pick: wiring.ReplicaPick, ticket: str) -> bytes:
        """wiring.route_answer(pick, {TICKET_HEADER: ticket}) as JSON; the frame around the
        ticket is encoded (and checked by route_answer) once per replica."""
        frame = self._frames.get(pick)
        if frame is None:
            if len(self._frames) >= _MAX_CACHED_PICKS:
                self._frames.clear()
            head, _, tail = json.dumps(wiring.route_answer(pick, {TICKET_HEADER: _TICKET_MARK}),
                                       separators=(",", ":")).partition(json.dumps(_TICKET_MARK))
            frame = self._frames[pick] = (head.encode(), tail.encode())
        if '"' in ticket:
            wiring.route_answer(pick, {TICKET_HEADER: ticket})  # raises: HAProxy cannot pass it
        return frame[0] + json.dumps(ticket).encode() + frame[1]


async def read_body(receive) -> bytes:
    """The request body; what arrived when the client went away (the answer is then lost anyway)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)
