"""The Ray app with `engine.tensor_parallel_size: 2` on CPU (its own local Ray): one engine replica
whose engine is rank 0 and starts one worker process over gloo; completions through HAProxy and
the Router; when Serve stops, the worker is gone too; a replica whose worker is killed fails its
health check (idle) and Serve replaces it. `num_gpus_per_replica: auto` reserves
tensor_parallel_size GPUs on a GPU cluster (the unit test)."""

import os
import signal

import httpx
import psutil
import pytest
from ray.serve._private import build_app as serve_build_app
from ray.serve._private import constants as serve_constants

from roseray.ray_serve.app import build_app
from tests.conftest import RayServeCluster
from tests.ray_serve.helpers import wait_for_routing
from tests.waiting import wait_until

pytestmark = pytest.mark.ray


def spawned_workers() -> set[int]:
    """Python processes started by multiprocessing's spawn (the engine's tensor-parallel ranks)."""
    found = set()
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "multiprocessing.spawn" in cmdline and "spawn_main" in cmdline:
            found.add(process.info["pid"])
    return found


TP_APP = {"engine": {"tensor_parallel_size": 2, "num_kv_blocks": 64}, "num_replicas": 1, "num_cpus_per_replica": 0.5}


def alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def complete(url: str) -> None:
    body = {"model": "random:tiny", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8


def test_a_tensor_parallel_replica_serves_and_stops_with_its_worker():
    before = spawned_workers()
    cluster = RayServeCluster(TP_APP)
    try:
        cluster.wait_ready()
        wait_for_routing(cluster.url)
        workers = spawned_workers() - before
        assert len(workers) == 1, workers  # rank 1 of the one replica
        for _ in range(3):
            complete(cluster.url)
    finally:
        cluster.close()
    assert not any(alive(pid) for pid in workers)


def test_a_replica_whose_worker_dies_is_replaced():
    before = spawned_workers()
    cluster = RayServeCluster(TP_APP)
    try:
        cluster.wait_ready()
        wait_for_routing(cluster.url)
        [worker] = spawned_workers() - before
        os.kill(worker, signal.SIGKILL)  # the replica is idle: only its health check can find this
        # Serve checks every 5 s, stops the replica (its rank 0) and starts one with a worker of its own
        [replacement] = wait_until(lambda: {pid for pid in spawned_workers() - before - {worker} if alive(pid)},
                                   timeout=180, interval=0.5, message="no replica with a new worker")
        wait_for_routing(cluster.url, timeout_s=120)
        complete(cluster.url)
        assert alive(replacement)
    finally:
        cluster.close()


def test_auto_gpus_per_replica_is_the_tensor_parallel_size(monkeypatch):
    monkeypatch.setattr(serve_constants, "RAY_SERVE_ENABLE_HA_PROXY", True)
    monkeypatch.setattr(serve_build_app, "RAY_SERVE_ENABLE_HA_PROXY", True)
    monkeypatch.setattr("roseray.ray_serve.app.ray.is_initialized", lambda: True)
    monkeypatch.setattr("roseray.ray_serve.app.ray.cluster_resources", lambda: {"GPU": 4.0, "CPU": 64.0})
    app = build_app({"engine": {"model": "random:tiny", "tensor_parallel_size": 2}})
    engine = serve_build_app.build_app(app, name="roseray").deployments[0]
    assert engine.ray_actor_options["num_gpus"] == 2.0 and engine.num_replicas == 2
    with pytest.raises(ValueError, match="fewer than the engine's tensor_parallel_size=2"):
        build_app({"engine": {"model": "random:tiny", "tensor_parallel_size": 2}, "num_gpus_per_replica": 1})
