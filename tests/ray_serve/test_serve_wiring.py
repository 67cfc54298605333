"""Canary for roseray's use of private Ray Serve hooks (roseray/ray_serve/wiring.py).

Every assertion here names a hook the HAProxy data path depends on. If a Ray upgrade
breaks one, this file fails first and says which; fix wiring.py (and haproxy_env.py)
before touching anything else. tests/test_serve_e2e.py runs the real thing."""

import inspect
import os
import re
import subprocess

import pytest
import ray
from ray.serve import Application
from ray.serve._private import build_app as serve_build_app
from ray.serve._private import constants as serve_constants
from ray.serve._private import haproxy as serve_haproxy
from ray.serve._private import haproxy_templates
from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.replica_wrapper import ReplicaSelection
from ray.serve._private.router import AsyncioRouter, SingletonThreadRouter
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import RunningReplica

from roseray.ray_serve import app as roseray_app
from roseray.ray_serve import haproxy_env, wiring
from roseray.ray_serve.routing import KVQueueRequestRouter


def test_ray_is_the_pinned_version():
    assert ray.__version__ == wiring.PINNED_RAY_VERSION, "Ray moved: re-check every hook in roseray/ray_serve/wiring.py"
    wiring.check_ray_version()


def test_ingress_request_router_hook_exists():
    assert hasattr(Application, "_with_ingress_request_router")
    assert "_ingress_request_router" in inspect.getsource(Application._with_ingress_request_router)


def test_choose_replica_still_takes_reserve_false():
    assert "choose_replica" in dir(DeploymentHandle)
    for router in (AsyncioRouter, SingletonThreadRouter):
        assert '"_reserve"' in inspect.getsource(router.choose_replica), router
    fields = ReplicaSelection.__dataclass_fields__
    assert "_replica" in fields
    assert isinstance(RunningReplica.backend_http_endpoint, property)
    assert isinstance(RunningReplica.routing_stats, property)
    assert callable(ReplicaID.to_full_id_str)


def test_router_answer_contract_with_haproxy():
    assert wiring.HEADERS_FIELD == "request_headers"
    assert wiring.ROUTER_HEADER_PREFIX == "x-serve-router-"
    lua = (os.path.dirname(serve_haproxy.__file__) + "/ingress_request_router.lua.tmpl")
    with open(lua) as f:
        lua_source = f.read()
    assert '"replica_id"' in lua_source and '"request_headers"' in lua_source and "req_set_header" in lua_source
    # HAProxy must strip client-sent router headers, or a client could forge a ticket
    assert re.search(r"del-header \{\{ ingress_request_router_header_prefix \}\} -m beg",
                     inspect.getsource(haproxy_templates))
    answer = wiring.route_answer(wiring.ReplicaPick("127.0.0.1", 30001, "SERVE_REPLICA::a#Engine#x"),
                                 {"x-serve-router-roseray-ticket": "v1.1.ab"})
    assert answer["request_headers"] == {"x-serve-router-roseray-ticket": "v1.1.ab"}
    with pytest.raises(ValueError):
        wiring.route_answer(wiring.ReplicaPick("h", 1, "r"), {"x-ticket": "v"})  # a client could send it


def test_haproxy_template_side_binds_are_what_the_loopback_wrapper_rewrites(tmp_path):
    source = inspect.getsource(haproxy_templates)
    assert "bind :{{ config.metrics_port }}" in source and "bind *:{{ config.stats_port }}" in source
    assert re.search(r"stats socket \{\{ config.socket_path \}\} mode 666", source)
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text("global\n    stats socket /x/admin.sock mode 666 level admin\n"
                   "frontend prometheus\n    bind :9101\n    mode http\n"
                   "frontend http_frontend\n    bind *:8000\n"
                   "listen stats\n  bind *:8404\n  stats enable\n")
    wrapper = haproxy_env.write_wrapper(str(tmp_path / "hap"), real_binary="/bin/true")
    subprocess.run([wrapper, "-db", "-f", str(cfg)], check=True, timeout=30)
    text = cfg.read_text()
    assert "bind 127.0.0.1:9101" in text and "bind 127.0.0.1:8404" in text
    assert "bind *:8000" in text  # the client-facing bind follows http_options.host, untouched
    assert "mode 600" in text and "mode 666" not in text
    assert oct(os.stat(tmp_path / "hap").st_mode & 0o777) == "0o700"


def test_the_wrapper_drops_the_splice_options_only_when_told(tmp_path, monkeypatch):
    assert re.search(r"option splice-request\s+option splice-response", inspect.getsource(haproxy_templates))
    config = ("defaults\n    mode http\n    option splice-request\n    option splice-response\n"
              "    option http-no-delay\n")
    assert _through_the_wrapper(tmp_path, config) == config  # Ray's options by default
    monkeypatch.setenv(haproxy_env.SPLICE_ENV, "0")
    assert _through_the_wrapper(tmp_path, config) == "defaults\n    mode http\n    option http-no-delay\n"


def _through_the_wrapper(tmp_path, config: str) -> str:
    """The HAProxy config `config` as the wrapper leaves it (with /bin/true as HAProxy)."""
    wrapper = haproxy_env.write_wrapper(str(tmp_path / "hap"), real_binary="/bin/true")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(config)
    subprocess.run([wrapper, "-f", str(cfg)], check=True, timeout=30)
    return cfg.read_text()


def test_the_wrapper_sets_the_routed_backends_reuse_mode_only_when_told(tmp_path, monkeypatch):
    assert "http-reuse always" in inspect.getsource(haproxy_templates)
    config = ("backend app-via-ingress-request-router\n    retry-on conn-failure empty-response\n"
              "    http-reuse always\n    server r1 127.0.0.1:30001\n"
              "backend app\n    http-reuse always\n")
    assert _through_the_wrapper(tmp_path, config) == config  # Ray's mode by default
    monkeypatch.setenv(haproxy_env.REUSE_ENV, "never")
    # the routed backend's only
    assert _through_the_wrapper(tmp_path, config) == config.replace("always\n    server", "never\n    server")


def test_serve_proxy_fallback_is_recognised_by_its_port():
    from ray.serve._private import proxy_state

    assert "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT" in inspect.getsource(proxy_state)
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
    """Ray's 8 MiB tune.bufsize with forwarded bodies costs HAProxy ~1-3 ms per request of a
    burst (scripts/ray_burst_probe.py); roseray sets 64 KiB, only when bodies are forwarded."""
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
