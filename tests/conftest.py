"""Test-suite setup. Without a GPU, Triton kernels run under its interpreter; the
variable must be set before anything imports triton (transformers does, via torch)."""

import os
import signal

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A background job of a non-interactive shell (`bash .ci/run &`) starts with SIGINT ignored, and
# every process it starts inherits that: the Ctrl-C tests' servers would never see theirs (they
# exited 0, not 130). The suite takes SIGINT as Python does, so its children do too.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

from roseray.config import EngineConfig  # noqa: E402

# ---- a tiny engine and tiny checkpoints -----------------------------------------------------------------------
# random:tiny on CPU with a small KV cache of short blocks (several blocks per prompt): the engine most tests build
TINY_ENGINE = {"model": "random:tiny", "device": "cpu", "block_size": 4, "num_kv_blocks": 64, "max_model_len": 256}


@pytest.fixture
def tiny_engine_config():
    """make(**overrides) -> EngineConfig of TINY_ENGINE with `overrides` on top."""
    return lambda **overrides: EngineConfig(**{**TINY_ENGINE, **overrides})


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """checkpoint(kind) -> the path of a tiny seeded HF checkpoint of `kind` (tests/models/hf_models.py),
    built once per session; tests read it and copy it before changing anything."""
    from tests.models.hf_models import make_tiny_model  # transformers: only for the tests that ask

    built: dict = {}

    def checkpoint(kind: str):
        if kind not in built:
            built[kind] = make_tiny_model(kind, tmp_path_factory.mktemp(kind))
        return built[kind]

    return checkpoint


# ---- one local Ray Serve cluster for the whole session ------------------------------------------------------
# tests/ray_serve/test_hardening_ray.py, test_serve_e2e.py, test_serve_router_server.py and
# tests/bench/test_locust.py share it (one start instead of four). Serve reads its HAProxy flags
# when it is imported, so the cluster runs in a subprocess (this file, run as a script) started
# with roseray.ray_serve.haproxy_env's environment; the test side talks to it over stdin/stdout,
# one JSON command per line:
#   {"op": "engines"}                   (node ip, port) of every engine replica's HTTP port
#   {"op": "replicas"}                  the Engine replicas as Serve's API lists them
#   {"op": "target"}                    the Engine deployment's target replica count (the autoscaler's decision)
#   {"op": "kill", "replica": "<id>"}   ray.kill the replica's actor (no restart by Ray core); replies once
#                                       the replica's process has exited
#   {"op": "integrity"}                 EngineDeployment.check_integrity on every running replica
# A test that breaks the cluster (kills a replica) waits for Serve to heal it before it ends.

import contextlib  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

RAY_APP = "roseray"
RAY_STATS_PERIOD_S = 0.25
RAY_ENGINE = {"model": "random:tiny", "max_num_seqs": 8, "max_waiting_requests": 64, "max_model_len": 2048,
              "num_kv_blocks": 130, "block_size": 16}
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A free loopback port between Ray's worker ports (10002-19999) and the kernel's
    ephemeral range (32768+): a port from the ephemeral range can be taken by any outgoing
    connection (Ray opens many) before the server that was meant to bind it does."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _process_alive(pid: int) -> bool:
    """Whether the local process `pid` still runs (a zombie has ended: it only awaits its reaping)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _run_ray_cluster(cfg: dict) -> None:
    """The subprocess side: Ray, serve_config.yaml's app with two CPU replicas of random:tiny
    (cfg["args"]: app args on top of those, cfg["args"]["engine"] engine fields on top of RAY_ENGINE)."""
    import ray
    import yaml
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve.schema import ServeInstanceDetails

    from roseray.ray_serve import wiring
    from roseray.ray_serve.app import build_app

    with open(os.path.join(_REPO, "serve_config.yaml")) as f:
        config = yaml.safe_load(f)
    args = config["applications"][0]["args"]
    args["engine"].update(RAY_ENGINE)
    args.update(num_replicas=2, num_cpus_per_replica=1, drain_timeout_s=1)
    args["router"]["stats_period_s"] = RAY_STATS_PERIOD_S
    overrides = dict(cfg.get("args", {}))
    args["engine"].update(overrides.pop("engine", {}))
    args.update(overrides)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             _temp_dir=cfg["ray_tmp"])
    serve.start(http_options={**config["http_options"], "port": cfg["port"]},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    serve.run(build_app(args), name=RAY_APP, route_prefix="/")
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    engine_handle = serve.get_deployment_handle("Engine", app_name=RAY_APP)

    def engine_details():
        details = ServeInstanceDetails(**ray.get(controller.get_serve_instance_details.remote()))
        return details.applications[RAY_APP].deployments["Engine"]

    def replicas() -> list[dict]:
        deployment = engine_details()
        return [{"replica_id": r.replica_id, "actor_name": r.actor_name, "state": str(r.state.value),
                 "pid": r.pid} for r in deployment.replicas]

    def integrity() -> dict:
        running = {r["replica_id"] for r in replicas() if r["state"] == "RUNNING"}
        seen: dict = {}
        for _ in range(60):  # the router spreads idle calls over the replicas (it counts its own picks)
            result = engine_handle.check_integrity.remote().result(timeout_s=30)
            seen[result["replica"]] = result
            if {name.split("#", 1)[1] for name in seen} >= running:
                break
        return seen

    def kill(replica: str) -> dict:
        """Returns once the replica's process is gone: ray.kill only asks the actor's worker to
        exit, and until it does the replica still answers what reaches it."""
        (target,) = [r for r in replicas() if r["replica_id"] == replica]
        ray.kill(ray.get_actor(target["actor_name"], namespace=SERVE_NAMESPACE), no_restart=True)
        started = time.monotonic()
        while _process_alive(target["pid"]):
            if time.monotonic() - started > 30:
                raise RuntimeError(f"the process {target['pid']} of {target['actor_name']} outlived ray.kill by 30 s")
            time.sleep(0.01)
        return {"killed": target["actor_name"], "exit_wait_s": time.monotonic() - started}

    ops = {"engines": lambda: wiring.engine_http_targets(RAY_APP), "replicas": replicas, "integrity": integrity,
           "kill": lambda replica: kill(replica), "target": lambda: engine_details().target_num_replicas}
    print("READY", flush=True)
    for line in sys.stdin:  # until the test side closes our stdin
        command = json.loads(line)
        try:
            reply = {"ok": ops[command.pop("op")](**command)}
        except Exception as error:  # noqa: BLE001 - reported to the test side
            reply = {"error": f"{type(error).__name__}: {error}"}
        print("REPLY " + json.dumps(reply), flush=True)
    serve.shutdown()
    ray.shutdown()


class RayServeCluster:
    """The test side of the shared cluster."""

    def __init__(self, args: dict | None = None) -> None:
        """`args`: app args over the shared cluster's (tests/ray_serve/test_serve_api_processes.py)."""
        from roseray.ray_serve.haproxy_env import ROUTER_REPLICAS_ENV, haproxy_env

        self.state_dir = tempfile.mkdtemp(prefix="rrh", dir="/tmp")  # short: HAProxy's unix socket paths
        self.ray_tmp = tempfile.mkdtemp(prefix="rrt", dir="/tmp")
        self.port, self.stats_port, self.metrics_port, self.fallback_port = (free_port() for _ in range(4))
        self.url = f"http://127.0.0.1:{self.port}"
        # one Router on any machine (auto would run four where it finds a GPU)
        env = {**os.environ, **haproxy_env(self.state_dir, router_replicas_per_node=1),
               "RAY_SERVE_HAPROXY_STATS_PORT": str(self.stats_port),
               "RAY_SERVE_HAPROXY_METRICS_PORT": str(self.metrics_port),
               "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(self.fallback_port),
               "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))}
        env.pop("RAY_ADDRESS", None)
        env.pop(ROUTER_REPLICAS_ENV, None)
        self.log = open(os.path.join(self.ray_tmp, "cluster.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps({"port": self.port, "ray_tmp": self.ray_tmp,
                                                              "args": args or {}})],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._lines: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=lambda: [self._lines.put(line) for line in iter(self.proc.stdout.readline, "")],
                         daemon=True).start()

    def wait_ready(self, timeout_s: float = 150) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line == "READY\n":
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray Serve cluster did not start:\n{self.log_tail()}")

    def log_tail(self, chars: int = 5000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-chars:]

    def command(self, op: str, timeout_s: float = 120, **kwargs):
        with self._lock:
            self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout_s
            while True:
                assert self.proc.poll() is None, f"the cluster process exited:\n{self.log_tail()}"
                try:
                    line = self._lines.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                except queue.Empty:
                    assert time.monotonic() < deadline, f"no reply to {op} in {timeout_s} s"
                    continue
                if line.startswith("REPLY "):
                    reply = json.loads(line[len("REPLY "):])
                    assert "error" not in reply, f"{op}: {reply['error']}"
                    return reply["ok"]

    def engines(self) -> list[tuple[str, int]]:
        return [tuple(e) for e in self.command("engines")]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def pytest_collection_modifyitems(session, config, items):
    """The modules that use the shared Ray cluster run last (each whole, in their order): the cluster
    then starts right before them and stops after them, instead of idling beside the rest of the suite
    (its processes take CPU even when idle, from the tests and from the other Ray clusters' starts)."""
    ray_modules = {getattr(item, "module", None) for item in items
                   if "ray_serve_cluster" in getattr(item, "fixturenames", ())}
    ray_modules.discard(None)
    if ray_modules:
        items[:] = ([item for item in items if getattr(item, "module", None) not in ray_modules]
                    + [item for item in items if getattr(item, "module", None) in ray_modules])


@pytest.fixture(scope="session")
def ray_serve_cluster():
    """A local Ray cluster in HAProxy mode running serve_config.yaml's app (two CPU engine
    replicas of random:tiny, RAY_ENGINE), shared by every test of the session."""
    cluster = RayServeCluster()
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.close()


if __name__ == "__main__":
    _run_ray_cluster(json.loads(sys.argv[1]))


@pytest.fixture(params=[False, True], ids=["mask filling", "mask ready"])
def mask_ready(request, monkeypatch):
    """Whether a held constrained step's grammar mask is filled when the next engine call starts (the
    call then samples it before it schedules, else after it prepared the next step): fixed, not timed."""
    from roseray.engine.structured_requests import PendingMask

    monkeypatch.setattr(PendingMask, "ready", property(lambda self: request.param))
    return request.param
