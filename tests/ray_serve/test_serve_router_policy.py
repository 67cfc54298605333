"""router.policy in the Ray app's args (roseray/ray_serve/app.py): roseray's KVQueueRequestRouter
("kv_queue", the default) or Ray Serve's default PowerOfTwoChoicesRequestRouter
("power_of_two"), both on roseray's data path (HAProxy -> Router deployment -> choose_replica
-> the engine replica streams itself), so that the two routers can be compared
(`python -m roseray.bench serving --server-port 8000` against each).

Unit: AppArgs accepts only the two policies; the built app gives the Engine deployment Ray's
class with no router kwargs and the Router deployment the policy. End to end: `serve run` of
serve_config.yaml with power_of_two and two CPU replicas of random:tiny whose engine loops
run in child processes, the GPU default (its own local Ray: the session's shared cluster,
tests/conftest.py, runs kv_queue with in-thread engines); requests through HAProxy succeed
on both replicas.
"""

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import tempfile

import httpx
import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private import build_app as serve_build_app
from ray.serve._private import constants as serve_constants
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

from roseray.ray_serve import wiring
from roseray.ray_serve.app import AppArgs, build_app, pick_with_reservation
from roseray.ray_serve.haproxy_env import haproxy_env
from roseray.ray_serve.routing import KVQueueRequestRouter
from tests.conftest import RAY_ENGINE, RAY_STATS_PERIOD_S, free_port
from tests.ray_serve.helpers import wait_for_routing
from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_app_args_validate_the_router_policy():
    assert AppArgs().router.policy == "kv_queue"
    assert AppArgs(router={"policy": "power_of_two"}).router.policy == "power_of_two"
    assert AppArgs(router={"policy": "cache_aware"}).router.policy == "cache_aware"
    for bad in ("round_robin", "pow2", "", None):
        with pytest.raises(ValidationError, match="policy"):
            AppArgs(router={"policy": bad})


def built_app(monkeypatch, policy: str | None):
    monkeypatch.setattr(serve_constants, "RAY_SERVE_ENABLE_HA_PROXY", True)
    monkeypatch.setattr(serve_build_app, "RAY_SERVE_ENABLE_HA_PROXY", True)
    router = {"stats_period_s": 0.25} if policy is None else {"stats_period_s": 0.25, "policy": policy}
    app = build_app({"engine": {"model": "random:tiny", "num_kv_blocks": 32}, "num_replicas": 2, "router": router})
    return serve_build_app.build_app(app, name="roseray")


@pytest.mark.parametrize("policy, router_class, kwargs", [
    (None, KVQueueRequestRouter, {"affinity_max_imbalance": 4, "stats_period_s": 0.25}),
    ("kv_queue", KVQueueRequestRouter, {"affinity_max_imbalance": 4, "stats_period_s": 0.25}),
    ("power_of_two", PowerOfTwoChoicesRequestRouter, {}),
    ("cache_aware", KVQueueRequestRouter, {"affinity_max_imbalance": 4, "stats_period_s": 0.25,
                                           "policy": "cache_aware", "prefill_weight": 1.0, "load_weight": None}),
])
def test_the_policy_picks_the_engine_deployments_request_router(monkeypatch, policy, router_class, kwargs):
    built = built_app(monkeypatch, policy)
    engine = built.deployments[0]
    config = engine._deployment_config.request_router_config
    assert config.get_request_router_class() is router_class
    assert config.request_router_kwargs == kwargs
    # the rest of the app is the same whatever the policy
    assert config.request_routing_stats_period_s == 0.25 and engine.num_replicas == 2
    assert built.ingress_request_router_deployment.name == "Router"
    assert built.ingress_request_router_deployment.init_args[-1] == (policy or "kv_queue")
    # only cache_aware has the engine replicas send their KV cache events, and the Router tokenize
    cache_aware = policy == "cache_aware"
    assert engine.init_kwargs["kv_snapshot_every"] == (20 if cache_aware else None)
    router_config = built.ingress_request_router_deployment.init_kwargs["engine_config"]
    assert (router_config is not None) == cache_aware


def test_power_of_two_picks_with_servers_reservation_not_the_pick_only_path():
    """Serve's pick-only path (`_reserve=False`, wiring.pick_replica) takes the first replica
    the RequestRouter ranks without asking any replica its queue length; Ray's class ranks
    two random replicas unsorted, so there it would route at random. The Router must call
    choose_replica() as a DeploymentHandle call does: probe, reserve, release."""
    calls = []

    class Replica:
        backend_http_endpoint = ("10.0.0.7", 30002)
        replica_id = type("Id", (), {"to_full_id_str": lambda self: "SERVE_REPLICA::roseray#Engine#b"})()

    class Handle:
        @contextlib.asynccontextmanager
        async def choose_replica(self, *args, **kwargs):
            calls.append((args, kwargs))
            yield type("Selection", (), {"_replica": Replica(), "replica_id": "b"})()

    pick = asyncio.run(pick_with_reservation(Handle()))
    assert pick == wiring.ReplicaPick("10.0.0.7", 30002, "SERVE_REPLICA::roseray#Engine#b")
    assert calls == [((), {})]  # no routing hint (Ray's class has no use for it) and no _reserve=False


# ---- end to end: power_of_two through HAProxy and the Router ------------------------------------------------
@pytest.fixture(scope="module")
def power_of_two_app():
    """`serve run` (a local Ray of its own) of serve_config.yaml with router.policy power_of_two."""
    work = tempfile.mkdtemp(prefix="rrp", dir="/tmp")  # short: HAProxy's unix socket paths
    with open(os.path.join(REPO, "serve_config.yaml")) as f:
        config = yaml.safe_load(f)
    port = free_port()
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["engine"].update(RAY_ENGINE)
    args["engine"]["engine_process"] = True  # as on GPU: each replica's engine loop in a child process
    args.update(num_replicas=2, num_gpus_per_replica=0, num_cpus_per_replica=0.5, drain_timeout_s=1)
    args["router"].update(policy="power_of_two", stats_period_s=RAY_STATS_PERIOD_S)
    with open(os.path.join(work, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    env = {**os.environ, **haproxy_env(os.path.join(work, "hap")), "RAY_ADDRESS": "local",
           "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    log = open(os.path.join(work, "serve.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.argv[0] = 'serve'; "
                             "from ray.serve.scripts import cli; cli()", "run", os.path.join(work, "config.yaml")],
                            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def log_tail() -> str:
        log.flush()
        with open(log.name) as f:
            return f.read()[-5000:]

    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:  # HAProxy is up
            assert proc.poll() is None, f"serve run exited:\n{log_tail()}"
            try:
                return httpx.get(url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        # a second local Ray on a loaded 2-core CI box: >120 s seen
        wait_until(ready, timeout=240, interval=0.1, message=lambda: f"the app started:\n{log_tail()}")
        wait_for_routing(url)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # serve run: serve.shutdown(), then its local Ray goes
        try:
            proc.wait(20)  # ~7 s alone; once 45+ s in the full suite: SIGTERM ends it too
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
        subprocess.run(["rm", "-rf", work], check=False)


@pytest.mark.ray
def test_power_of_two_routes_requests_to_both_replicas(power_of_two_app):
    url = power_of_two_app + "/v1/completions"

    async def one(client, i):
        body = {"prompt": f"pow2 {i}", "max_tokens": 8, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", url, json=body) as response:
            text = await response.aread()
            assert response.status_code == 200, text
            assert text.endswith(b"data: [DONE]\n\n") and b'"completion_tokens":8' in text, text[-300:]
            return response.headers["x-roseray-replica"]

    async def burst(n):
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    counts = collections.Counter(asyncio.run(burst(12)))
    # Ray's router picks at random between equal queues, and it routes only to replicas that run: on a
    # loaded CI box the second replica may still be loading when the first already answers (a whole
    # 2-core suite once saw 32 requests in ~10 s all go to the first), so more bursts, for up to 90 s
    wait_until(lambda: len(counts) == 2 or counts.update(asyncio.run(burst(4))) or len(counts) == 2,
               timeout=90, interval=0.05, message=lambda: f"both replicas answered: {counts}")
    assert len(counts) == 2 and sum(counts.values()) >= 12, counts
