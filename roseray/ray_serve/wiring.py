"""Every use of Ray Serve's private or unstable hooks, in one place.

roseray's data path is Ray Serve's HAProxy direct-streaming mode: HAProxy sends each
POST to an "ingress request router" deployment (/internal/route), which picks the
engine replica, and then forwards the request to that replica's own HTTP port. The hooks
this needs are private in Ray 2.60, so Ray is pinned exactly (pyproject) and
tests/ray_serve/test_serve_wiring.py fails loudly when an upgrade moves any of them:

  * `Application._with_ingress_request_router(router_app)` attaches the router;
  * `DeploymentHandle.choose_replica(..., _reserve=False)` runs the deployment's
    RequestRouter without dispatching or reserving a slot;
  * `ReplicaSelection._replica` -> RunningReplica.backend_http_endpoint and
    `replica_id.to_full_id_str()` name the replica in the /internal/route answer;
  * HAProxy forwards at most tune.bufsize (RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE)
    of a body to the router, with `X-Body-Truncated: <forwarded>/<full>` when it cut it;
  * the answer's `request_headers` field (applied by HAProxy after it strips every
    client-sent `x-serve-router-*` header) carries roseray's ticket;
  * `RAY_SERVE_ENABLE_HA_PROXY`, read by Serve at import time in every process;
  * HAProxy's fallback for a "pin-miss" (the router named a replica HAProxy's config does
    not list yet) is Serve's own proxy on RAY_SERVE_FALLBACK_PROXY_HTTP_PORT, which routes
    through a DeploymentHandle, i.e. through roseray's RequestRouter as well; such requests
    reach the engine's app with the proxy's ASGI scope and no ticket;
  * the controller's `get_target_groups` lists replica HTTP ports (tests and tools; an engine
    replica with API processes finds its own port there, then its listening socket), and
    the Router replicas' in `ingress_request_router_targets` (the lean Router server);
  * Serve's HTTP server in a replica is an asyncio (or uvloop) server on the replica's main
    loop, whose `close()` stops the accepting and leaves the connections it has
    (close_serve_listener);
  * Serve's wrapper answers HAProxy's health check (GET /-/healthz: 200 "success", 503
    "DRAINING"/"UNHEALTHY") on the replica's port before the app sees it; an API
    process on that port must answer it the same way, and the lean Router server asks the
    replica object's `_dataplane_health_check` (serve_replica_health);
  * `RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE` (ROUTER_BUFSIZE) bounds the body the
    lean Router server accepts;
  * the controller's `get_http_config` (HAProxy's address, for the ready line) and the worker's
    session directory (`ray._private.worker._global_node`).
"""

from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass

import ray
import uvicorn
from ray.serve import Application
from ray.serve._private import constants as serve_constants
from ray.serve._private.replica import Replica
from ray.serve.handle import DeploymentHandle

PINNED_RAY_VERSION = "2.60.0"
ROUTE_PATH = "/internal/route"
HEADERS_FIELD = serve_constants.RAY_SERVE_INGRESS_REQUEST_ROUTER_OPT_HEADERS_FIELD  # "request_headers"
ROUTER_HEADER_PREFIX = serve_constants.SERVE_INGRESS_ROUTER_HEADER_PREFIX  # "x-serve-router-"
SESSION_HEADER = serve_constants.SERVE_SESSION_ID  # forwarded by HAProxy to /internal/route
# set by HAProxy's Lua on /internal/route when the body was longer than its buffer: "<forwarded>/<full>"
BODY_TRUNCATED_HEADER = "x-body-truncated"
HEALTHZ_PATH = "/-/healthz"  # HAProxy's health check of each replica's port (http-check expect status 200)
HEALTHY_MESSAGE = serve_constants.HEALTHY_MESSAGE  # "success"

HAPROXY_REQUIRED = (
    "roseray's Ray Serve app runs in Ray Serve's HAProxy mode: RAY_SERVE_ENABLE_HA_PROXY=1 must be in the "
    "environment of every Ray node when it starts (and of `serve run`). Run "
    "`eval \"$(python -m roseray.ray_serve.haproxy_env)\"` before `ray start` / `serve run`.")


def check_ray_version() -> None:
    if ray.__version__ != PINNED_RAY_VERSION:
        raise RuntimeError(f"roseray's Serve wiring is tested with ray=={PINNED_RAY_VERSION} only (found "
                           f"{ray.__version__}); it uses private Serve hooks, see roseray/ray_serve/wiring.py")


def haproxy_enabled() -> bool:
    """Whether Serve in this process runs in HAProxy mode (fixed when Serve is imported)."""
    return bool(serve_constants.RAY_SERVE_ENABLE_HA_PROXY)


def attach_ingress_router(engine_app: Application, router_app: Application) -> Application:
    """Make `router_app` (serving ROUTE_PATH) decide the replica of every POST to `engine_app`."""
    return engine_app._with_ingress_request_router(router_app)


@dataclass(frozen=True)
class ReplicaPick:
    host: str
    port: int
    replica_id: str  # the full replica id HAProxy maps to its backend server


async def pick_replica(handle: DeploymentHandle, *route_args, reserve: bool = False) -> ReplicaPick:
    """Run the deployment's RequestRouter (route_args reach it as PendingRequest.args)
    and return the chosen replica's HTTP endpoint. By default without reserving a slot
    (HAProxy, not Serve, carries the request): the router's first-ranked replica.
    `reserve=True` runs Serve's full procedure instead (queue-length probes, a slot
    reserved and released when this returns), which routers that rank by Serve's queue
    lengths, like the default power-of-two router, need to pick at all."""
    options = {} if reserve else {"_reserve": False}
    async with handle.choose_replica(*route_args, **options) as selection:
        replica = selection._replica
        endpoint = replica.backend_http_endpoint
        if endpoint is None:
            raise RuntimeError(f"replica {selection.replica_id} has no HTTP port yet")
        return ReplicaPick(host=endpoint[0], port=endpoint[1], replica_id=replica.replica_id.to_full_id_str())


async def replica_routing_stats(handle: DeploymentHandle) -> dict:
    """The routing stats (its `record_routing_stats`) of the replica the deployment's RequestRouter
    ranks first, as the router last received them; nothing is sent to the replica."""
    async with handle.choose_replica(_reserve=False) as selection:
        return dict(selection._replica.routing_stats or {})


def _http_targets(app_name: str, routers: bool = False) -> list[tuple[str, int, str]]:
    """(node ip, port, actor name) of each replica of `app_name`'s ingress deployment as
    HAProxy sees them, or with `routers` of its ingress request router (the Router) as
    HAProxy's Lua asks them (`ingress_request_router_targets`). Blocking actor calls."""
    controller = ray.get_actor(serve_constants.SERVE_CONTROLLER_NAME, namespace=serve_constants.SERVE_NAMESPACE)
    groups = ray.get(controller.get_target_groups.remote(app_name, True))
    return sorted({(t.ip, t.port, t.name) for g in groups if g.app_name == app_name
                   and str(getattr(g.protocol, "value", g.protocol)).upper() == "HTTP"
                   for t in ((g.ingress_request_router_targets or ()) if routers else g.targets)})


def local_http_address() -> tuple[str, int, str]:
    """(host to connect to, port, URL for clients) of this node's HAProxy: Serve's http_options
    from the controller (a wildcard host: connect on loopback, show this node's address).
    A blocking actor call."""
    controller = ray.get_actor(serve_constants.SERVE_CONTROLLER_NAME, namespace=serve_constants.SERVE_NAMESPACE)
    options = ray.get(controller.get_http_config.remote())
    host, port = options.host or "127.0.0.1", int(options.port)
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1", port, f"http://{ray.util.get_node_ip_address()}:{port}"
    return host, port, f"http://{host}:{port}"


def session_dir() -> str:
    """This node's directory of the running Ray session (new at every Ray start)."""
    return ray._private.worker._global_node.get_session_dir_path()


def engine_http_targets(app_name: str) -> list[tuple[str, int]]:
    """(node ip, port) of each replica of `app_name`'s ingress deployment, as HAProxy
    sees them (call from a process connected to the cluster)."""
    return sorted({(ip, port) for ip, port, _ in _http_targets(app_name)})


def own_http_port(app_name: str, router: bool = False) -> int | None:
    """This replica's HTTP port as the controller lists it for HAProxy (`router`: this is a
    Router replica), or None while it is not listed yet (the port is bound after the
    constructor returns). Call from a replica's thread, not its event loop."""
    actor_name = ray.get_runtime_context().get_actor_name()
    return next((port for _, port, name in _http_targets(app_name, router) if name == actor_name), None)


def _live_objects() -> list:
    """Every object the garbage collector tracks, those frozen at start-up included
    (freeze_startup_objects: gc.get_objects() leaves them out)."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    try:
        return gc.get_objects()
    finally:
        if frozen:
            gc.freeze()


def close_serve_listener(port: int) -> bool:
    """Make Serve's HTTP server in this replica stop taking connections on `port`: close its
    server object (asyncio's or uvloop's, on the replica's main loop), which closes this
    process's listening handle, and shut its connections down the way uvicorn does when it
    stops (an idle keep-alive connection now, a busy one after its response): HAProxy then
    opens new ones, which the API processes accept. Found among the live objects, frozen
    ones included. False if no such server is found (a Ray upgrade)."""
    objects = _live_objects()
    listeners, http_servers = [], []
    for candidate in objects:
        kind = type(candidate)  # not isinstance: some objects' __class__ warns when read (torch's deprecated ones)
        if issubclass(kind, uvicorn.Server):
            http_servers.append(candidate)
        elif issubclass(kind, asyncio.AbstractServer) or (kind.__name__ == "Server" and hasattr(candidate, "get_loop")):
            try:
                if port in {s.getsockname()[1] for s in candidate.sockets or ()}:
                    listeners.append(candidate)
            except (OSError, AttributeError, TypeError, IndexError):
                continue
    del objects

    def close(listener) -> None:
        listener.close()
        for http_server in http_servers:
            if any(s is listener for s in http_server.servers):
                for connection in list(http_server.server_state.connections):
                    connection.shutdown()

    for listener in listeners:
        listener.get_loop().call_soon_threadsafe(close, listener)
    return bool(listeners)


def came_through_serve_proxy(scope: dict) -> bool:
    """Whether an ASGI request reached this replica through Serve's proxy (HAProxy's
    fallback, routed by the deployment's RequestRouter) rather than on the replica's own
    port. `scope["server"]` is the listening socket that accepted the client's connection,
    which a client cannot choose."""
    server = scope.get("server") or (None, None)
    return server[1] == serve_constants.RAY_SERVE_FALLBACK_PROXY_HTTP_PORT


def route_answer(pick: ReplicaPick, request_headers: dict[str, str]) -> dict:
    """The JSON body HAProxy's Lua expects from ROUTE_PATH. Header names must carry
    ROUTER_HEADER_PREFIX (so clients cannot set them) and values must not contain '"'."""
    for name, value in request_headers.items():
        if not name.startswith(ROUTER_HEADER_PREFIX) or '"' in value:
            raise ValueError(f"router header {name!r} cannot be passed through HAProxy")
    return {"host": pick.host, "port": pick.port, "replica_id": pick.replica_id, HEADERS_FIELD: request_headers}


# HAProxy's Lua forwards at most this much of a body to /internal/route (its tune.bufsize)
ROUTER_BUFSIZE = serve_constants.RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE


def serve_replica_health():
    """An async callable -> (healthy, message): what Serve's wrapper answers on GET /-/healthz
    for this replica (Replica._dataplane_health_check: "DRAINING" from the start of its
    graceful shutdown, "UNHEALTHY" after a failed check_health). Found among the live objects
    (call once, off the event loop if it matters); None if not found (a Ray upgrade)."""
    replicas = [o for o in _live_objects() if issubclass(type(o), Replica)]
    check = getattr(replicas[0], "_dataplane_health_check", None) if len(replicas) == 1 else None
    return check if asyncio.iscoroutinefunction(check) else None
