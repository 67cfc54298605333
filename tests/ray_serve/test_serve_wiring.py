"""Canary for roseray's use of private Ray Serve hooks (roseray/ray_serve/wiring.py).

Every assertion here names a hook the HAProxy data path depends on. If a Ray upgrade
breaks one, this file fails first and says which; fix wiring.py (and haproxy_env.py)
before touching anything else. tests/ray_serve/test_serve_e2e.py runs the real thing.

HAProxy's side is checked on the config Ray itself renders (HAProxyApi with one routed
backend), so a template change shows up as the rendered text roseray's wrapper rewrites."""

import asyncio
import contextlib
import inspect
import os
import re
import subprocess
import types

import pytest
import ray
from ray.serve import Application
from ray.serve._private import build_app as serve_build_app
from ray.serve._private import constants as serve_constants
from ray.serve._private.common import ReplicaID
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
from ray.serve._private.request_router.replica_wrapper import ReplicaSelection
from ray.serve._private.router import AsyncioRouter, SingletonThreadRouter
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import RunningReplica

from roseray.ray_serve import app as roseray_app
from roseray.ray_serve import haproxy_env, wiring
from roseray.ray_serve.routing import KVQueueRequestRouter

ROUTED_REPLICA = "SERVE_REPLICA::roseray#Engine#abc"


@pytest.fixture(scope="module")
def ray_haproxy_config(tmp_path_factory) -> tuple[str, str]:
    """(haproxy.cfg, ingress_request_router.lua) as Ray 2.60 writes them for one app whose
    Engine replica is reached through an ingress request router (the Router deployment)."""
    d = tmp_path_factory.mktemp("hap")
    cfg = HAProxyConfig(socket_path=str(d / "admin.sock"), server_state_base=str(d),
                        server_state_file=str(d / "state"), has_received_routes=True, has_received_servers=True)
    backend = BackendConfig(name="roseray", path_prefix="/",
                            servers=[ServerConfig("r1", "127.0.0.1", 30001, replica_id=ROUTED_REPLICA)],
                            ingress_request_router_servers=[ServerConfig("router1", "127.0.0.1", 30100)])
    api = HAProxyApi(cfg, {"roseray": backend}, config_file_path=str(d / "haproxy.cfg"))
    api._generate_config_file_internal()  # what HAProxyApi runs before each (re)start of HAProxy
    return (d / "haproxy.cfg").read_text(), (d / "ingress_request_router.lua").read_text()


def test_ray_is_the_pinned_version():
    assert ray.__version__ == wiring.PINNED_RAY_VERSION, "Ray moved: re-check every hook in roseray/ray_serve/wiring.py"
    wiring.check_ray_version()


def test_ingress_request_router_hook_exists():
    # what it does is checked on a built app: test_build_app_builds_engine_with_router_as_its_ingress_request_router
    assert callable(Application._with_ingress_request_router)


def test_choose_replica_with_reserve_false_picks_the_first_ranked_replica_without_reserving():
    """AsyncioRouter.choose_replica(_reserve=False) on a stand-in router: the request router's
    first candidate comes back, no slot is reserved, and `_reserve` does not reach the request."""
    replica = types.SimpleNamespace(replica_id=types.SimpleNamespace(unique_id="abc"), node_id="n1",
                                    _replica_info=types.SimpleNamespace(node_ip="10.0.0.2", port=30001),
                                    availability_zone=None, replica_metadata={})
    seen = []

    async def ranked(pending):
        seen.append(pending)
        yield [replica, "second"]

    async def no_reservation(pending):
        raise AssertionError("reserved a slot")

    async def resolved(pending):
        return None

    async def run():
        initialized = asyncio.Event()
        initialized.set()
        router = types.SimpleNamespace(
            _deployment_available=True, _request_router_initialized=initialized,
            _metrics_manager=types.SimpleNamespace(wrap_request_assignment=lambda meta: contextlib.nullcontext()),
            _resolve_args_with_metrics=resolved, _pick_and_reserve_replica=no_reservation,
            _active_request_router=types.SimpleNamespace(_choose_replicas_with_backoff=ranked),
            _make_upstream_crash_error=lambda error: error)
        meta = types.SimpleNamespace(call_method="__call__")
        async with AsyncioRouter.choose_replica(router, meta, "hint", _reserve=False) as selection:
            return selection

    selection = asyncio.run(run())
    assert (selection.node_ip, selection.port, selection._replica) == ("10.0.0.2", 30001, replica)
    assert selection._slot_token is None
    assert seen[0].args == ["hint"] and "_reserve" not in seen[0].kwargs
    # the handle's router runs AsyncioRouter's on its own loop and reads the flag only to decide on
    # cancellation: a one-line pin (Ray is pinned exactly, and a stand-in loop would test nothing more)
    assert '"_reserve"' in inspect.getsource(SingletonThreadRouter.choose_replica)
    assert "choose_replica" in dir(DeploymentHandle)
    fields = ReplicaSelection.__dataclass_fields__
    assert "_replica" in fields
    assert isinstance(RunningReplica.backend_http_endpoint, property)
    assert isinstance(RunningReplica.routing_stats, property)
    assert callable(ReplicaID.to_full_id_str)


def test_router_answer_contract_with_haproxy(ray_haproxy_config):
    config, lua = ray_haproxy_config
    assert wiring.HEADERS_FIELD == "request_headers"
    assert wiring.ROUTER_HEADER_PREFIX == "x-serve-router-"
    # the Lua reads the answer's replica_id (mapped to our replica's server) and sets its request_headers
    assert '"replica_id"' in lua and '"request_headers"' in lua and "req_set_header" in lua
    assert ROUTED_REPLICA in lua
    # HAProxy must strip client-sent router headers before the router runs, or a client could forge a ticket
    frontend = config[config.index("frontend http_frontend"):]
    strip = frontend.index(f"http-request del-header {wiring.ROUTER_HEADER_PREFIX} -m beg")
    assert strip < frontend.index("http-request lua.route_via_ingress_request_router")
    answer = wiring.route_answer(wiring.ReplicaPick("127.0.0.1", 30001, "SERVE_REPLICA::a#Engine#x"),
                                 {"x-serve-router-roseray-ticket": "v1.1.ab"})
    assert answer["request_headers"] == {"x-serve-router-roseray-ticket": "v1.1.ab"}
    with pytest.raises(ValueError):
        wiring.route_answer(wiring.ReplicaPick("h", 1, "r"), {"x-ticket": "v"})  # a client could send it


def _section(config: str, head: str) -> str:
    """One section of an HAProxy config: from its head line to the next unindented line."""
    start = config.index(head + "\n")
    following = re.search(r"^\S", config[start + len(head) + 1:], re.M)
    return config[start:start + len(head) + 1 + following.start()] if following else config[start:]


def test_the_wrapper_puts_rays_side_listeners_on_loopback(tmp_path, ray_haproxy_config):
    config, _ = ray_haproxy_config
    # Ray's own rendering listens on every interface for its metrics and stats, with a world-writable socket
    assert re.search(r"^\s+bind :\d+$", _section(config, "frontend prometheus"), re.M)
    assert re.search(r"^\s+bind \*:\d+$", _section(config, "listen stats"), re.M)
    assert re.search(r"stats socket \S+ mode 666", config)
    text = _through_the_wrapper(tmp_path, config, "-db")
    metrics, stats = _section(text, "frontend prometheus"), _section(text, "listen stats")
    assert re.search(r"^\s+bind 127\.0\.0\.1:\d+$", metrics, re.M), metrics
    assert re.search(r"^\s+bind 127\.0\.0\.1:\d+$", stats, re.M), stats
    # the client-facing bind follows http_options.host, untouched (the frontend's other change, the
    # router's failure answer: tests/ray_serve/test_haproxy_wrapper.py)
    binds = [re.findall(r"^\s+bind .*$", _section(c, "frontend http_frontend"), re.M) for c in (text, config)]
    assert binds[0] == binds[1] and binds[0]
    assert re.search(r"stats socket \S+ mode 600", text) and "mode 666" not in text
    assert oct(os.stat(tmp_path / "hap").st_mode & 0o777) == "0o700"


def test_the_wrapper_drops_the_splice_options_only_when_told(tmp_path, monkeypatch, ray_haproxy_config):
    config, _ = ray_haproxy_config
    assert re.search(r"option splice-request\s+option splice-response", config)
    default = _through_the_wrapper(tmp_path, config)
    assert re.search(r"option splice-request\s+option splice-response", default)  # Ray's options by default
    monkeypatch.setenv(haproxy_env.SPLICE_ENV, "0")
    text = _through_the_wrapper(tmp_path, config)
    assert "splice" not in text
    assert text == re.sub(r"    option splice-(request|response)\n", "", default)


def _through_the_wrapper(tmp_path, config: str, *flags: str) -> str:
    """The HAProxy config `config` as the wrapper leaves it (with /bin/true as HAProxy)."""
    wrapper = haproxy_env.write_wrapper(str(tmp_path / "hap"), real_binary="/bin/true")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(config)
    subprocess.run([wrapper, *flags, "-f", str(cfg)], check=True, timeout=30)
    return cfg.read_text()


def test_the_wrapper_sets_the_routed_backends_reuse_mode_only_when_told(tmp_path, monkeypatch, ray_haproxy_config):
    config, _ = ray_haproxy_config
    routed, plain = "backend roseray-via-ingress-request-router", "backend roseray"
    assert "http-reuse always" in _section(config, routed) and "http-reuse always" in _section(config, plain)
    default = _through_the_wrapper(tmp_path, config)
    assert "http-reuse always" in _section(default, routed)  # Ray's mode by default
    monkeypatch.setenv(haproxy_env.REUSE_ENV, "never")
    text = _through_the_wrapper(tmp_path, config)
    assert _section(text, routed) == _section(default, routed).replace("http-reuse always", "http-reuse never")
    assert _section(text, plain) == _section(default, plain)  # the routed backend's only


def test_serve_proxy_fallback_is_recognised_by_its_port():
    from ray.serve._private import proxy_state

    # Serve starts its fallback proxy on this port (ProxyStateManager, a private detail of the pinned Ray)
    assert proxy_state.RAY_SERVE_FALLBACK_PROXY_HTTP_PORT == serve_constants.RAY_SERVE_FALLBACK_PROXY_HTTP_PORT
    port = serve_constants.RAY_SERVE_FALLBACK_PROXY_HTTP_PORT
    assert wiring.came_through_serve_proxy({"server": ("127.0.0.1", port)})
    assert not wiring.came_through_serve_proxy({"server": ("127.0.0.1", 30001)})
    assert not wiring.came_through_serve_proxy({})


def test_haproxy_env_names_flags_serve_reads(tmp_path):
    env = haproxy_env.haproxy_env(str(tmp_path / "hap"), router_replicas_per_node=4)  # every name it can export
    assert haproxy_env.ROUTER_REPLICAS_ENV in env
    for name in env:
        assert hasattr(serve_constants, name), f"Serve no longer reads {name}"


def test_haproxy_env_bounds_the_router_body_buffer(tmp_path):
    """Ray's 8 MiB tune.bufsize with forwarded bodies slows HAProxy's admission of a burst;
    roseray sets 64 KiB, only when bodies are forwarded."""
    name = "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE"
    assert serve_constants.RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE == 8 * 1024 * 1024  # Ray's default
    assert haproxy_env.haproxy_env(str(tmp_path / "hap"))[name] == str(64 * 1024)
    assert haproxy_env.haproxy_env(str(tmp_path / "hap"), router_body_bytes=1 << 20)[name] == str(1 << 20)
    assert name not in haproxy_env.haproxy_env(str(tmp_path / "hap"), forward_body=False)


def test_build_app_refuses_without_haproxy(monkeypatch):
    monkeypatch.setattr(serve_constants, "RAY_SERVE_ENABLE_HA_PROXY", False)
    with pytest.raises(RuntimeError, match="RAY_SERVE_ENABLE_HA_PROXY=1"):
        roseray_app.build_app({})


def test_build_app_builds_engine_with_router_as_its_ingress_request_router(monkeypatch):
    monkeypatch.setattr(serve_constants, "RAY_SERVE_ENABLE_HA_PROXY", True)
    monkeypatch.setattr(serve_build_app, "RAY_SERVE_ENABLE_HA_PROXY", True)
    app = roseray_app.build_app({"engine": {"model": "random:tiny", "num_kv_blocks": 32}, "num_replicas": 2})
    built = serve_build_app.build_app(app, name="roseray")
    assert built.ingress_deployment_name == "Engine"
    assert [d.name for d in built.deployments] == ["Engine"]
    assert built.ingress_request_router_deployment.name == "Router"
    engine = built.deployments[0]
    assert engine.num_replicas == 2
    router_config = engine._deployment_config.request_router_config
    assert router_config.get_request_router_class() is KVQueueRequestRouter
    assert router_config.request_routing_stats_period_s == 0.5


def test_build_app_places_engine_replicas_by_custom_resource_and_per_node_cap(monkeypatch):
    """resources_per_replica and max_replicas_per_node reach the Engine deployment (the two-node run:
    tests/ray_serve/test_multi_node.py); unset, neither is there."""
    monkeypatch.setattr(serve_constants, "RAY_SERVE_ENABLE_HA_PROXY", True)
    monkeypatch.setattr(serve_build_app, "RAY_SERVE_ENABLE_HA_PROXY", True)
    args = {"engine": {"model": "random:tiny", "num_kv_blocks": 32}, "num_replicas": 2, "num_gpus_per_replica": 0}
    pinned = serve_build_app.build_app(roseray_app.build_app(
        {**args, "resources_per_replica": {"roseray_engine_node": 1}, "max_replicas_per_node": 1}),
        name="roseray").deployments[0]
    assert pinned.ray_actor_options["resources"] == {"roseray_engine_node": 1}
    assert pinned.ray_actor_options["num_cpus"] == 1 and pinned.ray_actor_options["num_gpus"] == 0
    assert pinned._replica_config.max_replicas_per_node == 1
    plain = serve_build_app.build_app(roseray_app.build_app(args), name="roseray").deployments[0]
    assert "resources" not in plain.ray_actor_options and plain._replica_config.max_replicas_per_node is None
