"""A two-node Ray cluster on this one machine, for tests/ray_serve/test_multi_node.py: a head and a
worker, each started with `ray start --block` in a session of its own (so that each node's processes
can be found, and the worker node stopped, by session id, without touching any other Ray on the
machine), each with its own temp dir, agent ports and direct-ingress port range, and both with
roseray.ray_serve.haproxy_env's environment. HAProxy runs on the head only (`proxy_location:
HeadOnly`: two HAProxies on one host would both bind the HTTP port).

Every engine replica reserves the custom resource ENGINE_SLOT, of which each node offers one, so the
app's two replicas land one per node; the worker also offers WORKER_MARK, by which the test tells the
nodes apart. Run as a script, this file deploys the app on the running cluster (a Ray driver of its
own: the test process never imports Ray) and prints {replica id: "head" | "worker"}."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from roseray.ray_serve.background import haproxy_pids, session_pids
from roseray.ray_serve.haproxy_env import ROUTER_REPLICAS_ENV, haproxy_env
from tests.conftest import RAY_ENGINE, RAY_STATS_PERIOD_S, free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
APP = "roseray"
ENGINE_SLOT = "roseray_engine_node"
WORKER_MARK = "roseray_worker_node"
# The GCS declares a node dead after this many failed health checks of its raylet in a row, one every
# HEALTH_CHECK_PERIOD_MS (Ray's defaults: 5 of 3 s, after a 5 s initial delay): 4-5 s after a loss,
# well after the Router has set the lost node's replica aside (test_multi_node.py tells the two
# apart); a timeout of 2 s keeps a busy 2-core machine from failing a live node.
HEALTH_CHECK_PERIOD_MS = 1000
HEALTH_CHECK_FAILURES = 5
START_TIMEOUT_S = 120


def app_args() -> dict:
    """serve_config.yaml's app args: two CPU replicas of random:tiny, one per node."""
    return {"engine": dict(RAY_ENGINE), "num_replicas": 2, "num_gpus_per_replica": 0, "num_cpus_per_replica": 1,
            "resources_per_replica": {ENGINE_SLOT: 1}, "max_replicas_per_node": 1, "drain_timeout_s": 1,
            "router": {"stats_period_s": RAY_STATS_PERIOD_S}}


class TwoNodeCluster:
    def __init__(self, log_dir: Path) -> None:
        self.state_dir = tempfile.mkdtemp(prefix="rrh", dir="/tmp")  # short: HAProxy's unix socket paths
        self.head_tmp = tempfile.mkdtemp(prefix="rrt", dir="/tmp")
        self.worker_tmp = tempfile.mkdtemp(prefix="rrt", dir="/tmp")
        self.log_dir = log_dir
        self.gcs_port, self.http_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        bin_dir = os.path.dirname(sys.executable)
        self.ray = os.path.join(bin_dir, "ray")
        self.env = {**os.environ, **haproxy_env(self.state_dir, router_replicas_per_node=1),
                    "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
                    "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
                    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
                    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
                    # token auth, as `ray start` has by default, with a token of this cluster's own
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    "RAY_health_check_period_ms": str(HEALTH_CHECK_PERIOD_MS),
                    "RAY_health_check_timeout_ms": "2000",
                    "RAY_health_check_failure_threshold": str(HEALTH_CHECK_FAILURES),
                    "RAY_health_check_initial_delay_ms": "0",
                    "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.env.pop("RAY_ADDRESS", None)
        self.env.pop(ROUTER_REPLICAS_ENV, None)  # one Router (auto would run four where it finds a GPU)
        self.head: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    def _node(self, name: str, args: list[str], temp_dir: str, resources: dict, ports: tuple[int, int]):
        """`ray start --block` of one node in a session of its own; its replicas take HTTP ports in `ports`."""
        env = {**self.env, "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(ports[0]),
               "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(ports[1])}
        command = [self.ray, "start", "--block", f"--temp-dir={temp_dir}",
                   f"--resources={json.dumps(resources)}", f"--dashboard-agent-listen-port={free_port()}",
                   "--disable-usage-stats", *args]
        with open(self.log_dir / f"{name}.log", "wb") as log:
            return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def start(self) -> None:
        """The head, then (once its GCS listens) the worker."""
        base = free_port() // 100 * 100  # two disjoint ranges of replica ports
        self.head = self._node("head", ["--head", f"--port={self.gcs_port}", "--num-cpus=2",
                                        "--include-dashboard=false", f"--ray-client-server-port={free_port()}"],
                               self.head_tmp, {ENGINE_SLOT: 1}, (base, base + 49))

        def gcs_listens() -> bool:
            assert self.head.poll() is None, f"the head's ray start exited:\n{self.log('head')}"
            try:
                socket.create_connection(("127.0.0.1", self.gcs_port), timeout=1).close()
            except OSError:
                return False
            return True

        wait_until(gcs_listens, timeout=START_TIMEOUT_S, interval=0.2, message="the head's GCS listens")
        self.worker = self._node("worker", [f"--address=127.0.0.1:{self.gcs_port}", "--num-cpus=1"],
                                 self.worker_tmp, {ENGINE_SLOT: 1, WORKER_MARK: 1}, (base + 50, base + 99))

    def deploy(self) -> dict[str, str]:
        """The app on both nodes (this file as a Ray driver); {replica id: "head" | "worker"}."""
        result = subprocess.run([sys.executable, __file__, json.dumps({"gcs_port": self.gcs_port,
                                                                       "http_port": self.http_port})],
                                env=self.env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        assert result.returncode == 0, f"deploy failed:\n{result.stderr[-6000:]}\n{self.log('head')[-3000:]}"
        return json.loads(result.stdout.strip().splitlines()[-1])

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_worker(self) -> list[int]:
        """SIGKILL every process of the worker node (its raylet, agents and the replica's worker process): the
        node is lost, as when its machine fails. The pids killed."""
        pids = session_pids(self.worker.pid)
        _kill(pids)
        self.worker.wait(30)
        return pids

    def close(self) -> None:
        """Every process of both nodes and the head's HAProxy killed; the temp dirs removed."""
        for node in (self.worker, self.head):
            if node is not None:
                _kill(session_pids(node.pid))
                node.wait(30)
        _kill(haproxy_pids(self.state_dir))
        for path in (self.state_dir, self.head_tmp, self.worker_tmp):
            shutil.rmtree(path, ignore_errors=True)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _deploy(cfg: dict) -> None:
    """The driver side: serve.start on the head (HAProxy there only), the app, and where its replicas run."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve.schema import ServeInstanceDetails

    from roseray.ray_serve.app import build_app

    ray.init(address=f"127.0.0.1:{cfg['gcs_port']}", logging_level="WARNING",
             log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": cfg["http_port"]},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    serve.run(build_app(app_args()), name=APP, route_prefix="/")
    worker_nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"] and WORKER_MARK in node["Resources"]}
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ServeInstanceDetails(**ray.get(controller.get_serve_instance_details.remote()))
    replicas = details.applications[APP].deployments["Engine"].replicas
    print(json.dumps({r.replica_id: "worker" if r.node_id in worker_nodes else "head" for r in replicas}), flush=True)


if __name__ == "__main__":
    _deploy(json.loads(sys.argv[1]))
