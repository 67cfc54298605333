"""Several API processes in one Ray Serve engine replica (roseray/ray_serve/replica_api_processes.py).

Unit: the app args (auto: 4 on GPU replicas, 1 on CPU; the engine child it needs),
finding a listening socket among this process's descriptors, the /-/healthz answers of an
API process. End to end (its own local Ray: the session's cluster runs one API process
per replica): two CPU replicas of random:tiny, each with its engine in a child process and
three API processes on its port; traffic through HAProxy and the Router reaches the API
processes, which take every new connection once they serve, refuse requests without the
Router's ticket or the API key, answer HAProxy's health check, share their request metrics, free a
disconnected stream's KV blocks; when Serve stops, none of them is left.
"""

import asyncio
import collections
import contextlib
import os
import socket
import subprocess
import time

import httpx
import pytest
from pydantic import ValidationError
from ray.serve._private import build_app as serve_build_app
from ray.serve._private import constants as serve_constants

from roseray.config import EngineConfig
from roseray.ray_serve.app import AppArgs, build_app
from roseray.ray_serve.replica_api_worker import ServeProbes
from roseray.ray_serve.replica_port import listening_socket_fd
from roseray.runtime.async_engine import LoopState
from tests.conftest import RayServeCluster
from tests.ray_serve.helpers import wait_for_routing
from tests.waiting import async_wait_until, wait_until

API_PROCESSES = 3
API_KEY = "api-processes-key"  # the app's api_key: every API process checks it
AUTH = {"authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 200  # streams that overlap (see served_by)
WORKER_MODULE = "roseray.ray_serve.replica_api_worker"


# ---- unit -----------------------------------------------------------------------------------------------------
def built_engine(monkeypatch, gpus: float, **args):
    monkeypatch.setattr(serve_constants, "RAY_SERVE_ENABLE_HA_PROXY", True)
    monkeypatch.setattr(serve_build_app, "RAY_SERVE_ENABLE_HA_PROXY", True)
    app = build_app({"engine": {"model": "random:tiny", "num_kv_blocks": 32}, "num_replicas": 1,
                     "num_gpus_per_replica": gpus, **args})
    return serve_build_app.build_app(app, name="roseray").deployments[0]


def engine_args(deployment) -> tuple[EngineConfig, int]:
    """(engine config, api processes) the Engine replicas are built with."""
    engine_config, server_config, _ = deployment.init_args
    return engine_config, server_config.api_processes


@pytest.mark.parametrize("gpus, args, expected, engine_process", [
    (1, {}, 4, True),  # auto on a GPU replica: 4, the engine in its child (the CUDA default anyway)
    (0, {}, 1, None),  # auto on CPU: one, the engine where the config says
    (0, {"api_processes_per_replica": 3}, 3, True),  # asked for on CPU: the engine moves to a child
    (1, {"engine": {"model": "random:tiny", "num_kv_blocks": 32, "engine_process": False}}, 1, False),
])
def test_api_processes_per_replica(monkeypatch, gpus, args, expected, engine_process):
    engine, api_processes = engine_args(built_engine(monkeypatch, gpus, **args))
    assert api_processes == expected and engine.engine_process is engine_process


def test_api_processes_refuse_an_in_process_engine_and_nonsense(monkeypatch):
    with pytest.raises(ValueError, match="engine in its own process"):
        built_engine(monkeypatch, 0, api_processes_per_replica=2,
                     engine={"model": "random:tiny", "num_kv_blocks": 32, "engine_process": False})
    with pytest.raises(ValueError, match=">= 1"):
        built_engine(monkeypatch, 0, api_processes_per_replica=0)
    with pytest.raises(ValidationError):
        AppArgs(api_processes_per_replica="many")


def test_listening_socket_fd_finds_the_listener_and_nothing_else():
    with socket.socket() as listener, socket.socket() as bound_only:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        bound_only.bind(("127.0.0.1", 0))
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            with accepted:
                assert listening_socket_fd(port) == listener.fileno()  # not the accepted connection on that port
                with pytest.raises(RuntimeError, match="no socket"):
                    listening_socket_fd(bound_only.getsockname()[1])  # bound, not listening
                with pytest.raises(RuntimeError, match="no socket"):
                    listening_socket_fd(client.getsockname()[1])


class _Engine:
    def __init__(self, state: LoopState, ready: bool) -> None:
        self.state, self.is_ready = state, ready


@pytest.mark.parametrize("state, ready, status, body", [
    (LoopState.RUNNING, True, 200, b"success"),
    (LoopState.DRAINING, False, 503, b"DRAINING"),
    (LoopState.STOPPED, False, 503, b"DRAINING"),
    (LoopState.RUNNING, False, 503, b"UNHEALTHY"),  # stuck loop
    (LoopState.DEAD, False, 503, b"UNHEALTHY"),
])
def test_an_api_process_answers_haproxys_health_check_as_serve_does(state, ready, status, body):
    passed = []

    async def app(scope, receive, send):
        passed.append(scope["path"])

    async def call(path):
        sent = []

        async def send(message):
            sent.append(message)

        await ServeProbes(app, _Engine(state, ready))({"type": "http", "path": path}, None, send)
        return sent

    sent = asyncio.run(call("/-/healthz"))
    assert sent[0]["status"] == status and sent[1]["body"] == body and not passed
    assert asyncio.run(call("/v1/models")) == [] and passed == ["/v1/models"]  # everything else: the app


# ---- end to end -----------------------------------------------------------------------------------------------
def worker_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", WORKER_MODULE], capture_output=True, text=True).stdout
    return {int(pid) for pid in out.split()}


@pytest.fixture(scope="module")
def cluster():
    before = worker_pids()
    cluster = RayServeCluster({"api_processes_per_replica": API_PROCESSES, "engine": {"engine_process": True},
                               "num_cpus_per_replica": 0.5, "api_key": API_KEY})
    try:
        cluster.wait_ready()
        wait_for_routing(cluster.url, headers=AUTH)
        # they start once Serve lists the replica's port; once all serve, the replica's own server stops
        # accepting (HAProxy may keep a connection or two it opened before: those stay with it)
        deadline = time.monotonic() + 90
        for _, port in cluster.engines():
            seen, streak = set(), [0]

            def all_serve(port=port, seen=seen, streak=streak) -> bool:
                with contextlib.suppress(httpx.HTTPError):  # a new connection each time
                    name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5,
                                     headers=AUTH).headers["x-roseray-replica"]
                    seen.add(name.rsplit("/", 1)[-1])
                    streak[0] = streak[0] + 1 if "/api" in name else 0
                return seen >= {f"api{i}" for i in range(1, API_PROCESSES + 1)} and streak[0] >= 10

            wait_until(all_serve, timeout=max(0.0, deadline - time.monotonic()), interval=0.05,
                       message=lambda port=port, seen=seen: f"{port}: {seen}, {worker_pids() - before}\n"
                                                            f"{cluster.log_tail()}")
        yield cluster
    finally:
        cluster.close()
    wait_until(lambda: not worker_pids() - before, timeout=30, interval=0.1,
               message=lambda: f"API processes gone after Serve stopped; left: {worker_pids() - before}")


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> str:
    body = {"prompt": f"api processes {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as response:
        text = await response.aread()
        assert response.status_code == 200, text
        assert text.endswith(b"data: [DONE]\n\n") and f'"completion_tokens":{MAX_TOKENS}'.encode() in text, text[-300:]
        return response.headers["x-roseray-replica"]


def served_by(url: str, rounds: int = 1, per_round: int = 12) -> collections.Counter:
    """Who served `rounds` bursts of `per_round` streams. HAProxy keeps its connections to a
    replica open and reuses them (http-reuse always), and the Router admits a burst one
    request after another: the streams must last long enough to overlap, or the few
    connections HAProxy opened before the API processes were up (the replica's own server
    took those) carry them all."""
    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:  # its own connections: HAProxy's open new ones
            return await asyncio.gather(*(_stream(client, url, i) for i in range(per_round)))

    counts = collections.Counter()
    for _ in range(rounds):
        counts.update(asyncio.run(burst()))
    return counts


@pytest.mark.ray
def test_streams_through_haproxy_reach_the_api_processes(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key=API_KEY)
    chunks = list(client.chat.completions.create(
        model="random:tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 5

    counts = served_by(cluster.url)
    processes = {name.split("/")[-1] for name in counts if "/api" in name}
    assert len(processes) >= 2 and processes <= {f"api{i}" for i in range(1, API_PROCESSES + 1)}, counts


@pytest.mark.ray
def test_every_process_on_a_replica_port_refuses_unrouted_or_keyless_requests_and_answers_health_checks(cluster):
    for _, port in cluster.engines():
        direct = f"http://127.0.0.1:{port}"
        answered = collections.Counter()
        for _ in range(16):  # new connections: the processes take turns accepting them
            body = {"prompt": "sneaky", "max_tokens": 2}
            refused = httpx.post(direct + "/v1/completions", json=body, timeout=10, headers=AUTH)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_routed", refused.text
            answered[refused.headers["x-roseray-replica"]] += 1
            keyless = httpx.post(direct + "/v1/completions", json=body, timeout=10)
            assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key", keyless.text
            answered[keyless.headers["x-roseray-replica"]] += 1
            health = httpx.get(direct + "/-/healthz", timeout=10)
            assert (health.status_code, health.text) == (200, "success")
        assert all("/api" in name for name in answered), answered  # the replica's own server stopped accepting


def scrape(url: str) -> dict[str, float]:
    values = collections.defaultdict(float)
    for line in httpx.get(url + "/metrics", timeout=10, headers=AUTH).text.split("\n"):
        if line.startswith("roseray:") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] += float(value)
    return values


@pytest.mark.ray
def test_metrics_count_the_requests_of_every_process(cluster):
    engines = cluster.engines()

    def successes() -> float:  # each replica's port, whichever of its processes answers
        return sum(scrape(f"http://127.0.0.1:{port}")["roseray:request_success_total"] for _, port in engines)

    # settled: two scrapes in a row agree (the processes' shared snapshots)
    start = wait_until(lambda: (first := successes()) == successes() and (first,), timeout=5, interval=0.05,
                       message="the success counts settled")[0]
    counts = served_by(cluster.url, rounds=2)
    seen = [start]
    wait_until(lambda: seen.append(successes()) or seen[-1] >= start + sum(counts.values()),  # snapshots: <= 1 s old
               timeout=10, interval=0.05, message=lambda: f"{(start, seen[-1], counts)}")
    assert seen[-1] == start + sum(counts.values())  # nothing counted twice


@pytest.mark.ray
def test_a_disconnect_on_an_api_process_frees_its_kv_blocks(cluster):
    def in_use() -> float:
        return sum(scrape(f"http://127.0.0.1:{port}")["roseray:kv_cache_usage_perc"] for _, port in cluster.engines())

    async def cut_streams(n: int) -> list[str]:
        async def one(client, i):
            body = {"prompt": f"cut {i} " * 20, "max_tokens": 1500, "ignore_eos": True, "stream": True}
            async with client.stream("POST", cluster.url + "/v1/completions", json=body, headers=AUTH) as response:
                assert response.status_code == 200
                async for _ in response.aiter_bytes():
                    return response.headers["x-roseray-replica"]  # leave mid-stream: the connection closes

        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    names = asyncio.run(cut_streams(6))
    assert any("/api" in name for name in names), names
    wait_until(lambda: in_use() == 0, timeout=20, interval=0.05,
               message=f"KV blocks freed after the disconnects ({names})")
    assert all(r["num_running"] == 0 for r in cluster.command("integrity").values())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_close_serve_listener_stops_this_process_accepting_and_leaves_other_copies(loop):
    """What the replica does once its API processes serve: its own server (asyncio's, or
    uvloop's as in a Serve replica; created after gc.freeze(), as at start-up) stops taking
    connections, while a copy of the socket (an API process's) still accepts them."""
    import gc

    from roseray.ray_serve import wiring

    async def main():
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        listener = listening_socket_fd(port)
        inode = os.readlink(f"/proc/self/fd/{listener}")
        copy = socket.socket(fileno=os.dup(listener))  # the API process's
        gc.freeze()
        try:
            assert await asyncio.to_thread(wiring.close_serve_listener, port)
        finally:
            gc.unfreeze()

        def listener_closed() -> bool:  # the close runs on this loop, soon after the call
            try:
                return os.readlink(f"/proc/self/fd/{listener}") != inode
            except FileNotFoundError:
                return True

        await async_wait_until(listener_closed, timeout=5, message="this process's listening socket closed")
        with copy, socket.create_connection(("127.0.0.1", port), timeout=2):
            copy.settimeout(2)
            accepted, _ = copy.accept()  # the connection went to the copy: this process no longer accepts
            accepted.close()
        assert not await asyncio.to_thread(wiring.close_serve_listener, port)  # nothing listens here any more

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())


def test_close_serve_listener_shuts_down_the_servers_idle_keep_alive_connections():
    """HAProxy keeps the connections it opened to a replica and reuses them: those the
    replica's own server accepted before the API processes served must close, or they would
    carry requests to it for as long as HAProxy keeps them."""
    import http.client

    import uvicorn

    from roseray.ray_serve import wiring

    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    def keep_alive_client(port: int, closed: "asyncio.Future", loop) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/")
        assert conn.getresponse().read() == b"ok"  # the connection stays open (keep-alive)
        loop.call_soon_threadsafe(closed.set_result, conn)

    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        await async_wait_until(lambda: server.started, message="uvicorn started")
        opened = asyncio.get_running_loop().create_future()
        await asyncio.to_thread(keep_alive_client, port, opened, asyncio.get_running_loop())
        conn = await opened
        assert len(server.server_state.connections) == 1
        assert await asyncio.to_thread(wiring.close_serve_listener, port)
        await async_wait_until(lambda: not server.server_state.connections, timeout=5,
                               message="the idle keep-alive connection closed")
        assert await asyncio.to_thread(lambda: conn.sock.recv(1)) == b""  # the client sees it closed
        conn.close()
        server.should_exit = True
        await task

    asyncio.run(main())
