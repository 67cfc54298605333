"""The Ray Serve app end to end: a local Ray cluster in HAProxy mode, serve_config.yaml's
app with two CPU engine replicas of random:tiny, traffic through HAProxy and the Router.

Serve reads its HAProxy flags when it is imported, so the cluster runs in a subprocess
(this file, run as a script) started with roseray.serve.haproxy_env's environment."""

import asyncio
import collections
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APP = "roseray"
STATS_PERIOD_S = 0.25
ENGINE = {"model": "random:tiny", "max_num_seqs": 8, "max_waiting_requests": 64, "max_model_len": 2048,
          "num_kv_blocks": 130, "block_size": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the cluster (subprocess side) ---------------------------------------------------------------
def run_cluster(cfg: dict) -> None:
    import ray
    import yaml
    from ray import serve

    from roseray.serve import wiring
    from roseray.serve.app import build_app

    with open(os.path.join(REPO, "serve_config.yaml")) as f:
        config = yaml.safe_load(f)
    args = config["applications"][0]["args"]
    args["engine"].update(ENGINE)
    args.update(num_replicas=2, num_cpus_per_replica=1, drain_timeout_s=1)
    args["router"]["stats_period_s"] = STATS_PERIOD_S
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             _temp_dir=cfg["ray_tmp"])
    serve.start(http_options={**config["http_options"], "port": cfg["port"]},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    serve.run(build_app(args), name=APP, route_prefix="/")
    print("READY " + json.dumps({"engines": wiring.engine_http_targets(APP)}), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    serve.shutdown()
    ray.shutdown()


# ---- the test side ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    from roseray.serve.haproxy_env import haproxy_env

    state_dir = tempfile.mkdtemp(prefix="rrh", dir="/tmp")  # short: HAProxy's unix socket paths
    ray_tmp = tempfile.mkdtemp(prefix="rrt", dir="/tmp")
    port, stats_port, metrics_port, fallback_port = free_port(), free_port(), free_port(), free_port()
    env = {**os.environ, **haproxy_env(state_dir),
           "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port), "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port),
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_port),
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    log = open(os.path.join(ray_tmp, "cluster.log"), "w+")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps({"port": port, "ray_tmp": ray_tmp})],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while not any(line.startswith("READY ") for line in lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"the cluster did not start:\n{log.read()[-5000:]}")
            time.sleep(0.2)
        info = json.loads(next(line for line in lines if line.startswith("READY "))[len("READY "):])
        url = f"http://127.0.0.1:{port}"
        wait_for_routing(url)
        yield {"url": url, "engines": info["engines"], "stats_port": stats_port, "metrics_port": metrics_port,
               "fallback_port": fallback_port}
    finally:
        with contextlib.suppress(Exception):
            proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        shutil.rmtree(state_dir, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def wait_for_routing(url: str, timeout_s: float = 60) -> None:
    """HAProxy learns the Router and the replicas a little after serve.run returns; until
    then it sends requests to replicas without a ticket (503) or fails them."""
    deadline = time.monotonic() + timeout_s
    successes, last = 0, None
    while successes < 6:
        try:
            response = httpx.post(url + "/v1/completions", json={"prompt": "warm", "max_tokens": 1}, timeout=10)
            successes = successes + 1 if response.status_code == 200 else 0
            last = (response.status_code, dict(response.headers), response.text[:2000])
        except httpx.HTTPError as error:
            successes, last = 0, repr(error)
        assert time.monotonic() < deadline, f"HAProxy never routed requests through the Router; last: {last}"
        time.sleep(0.25)


def test_openai_client_chat_and_completion_through_the_router(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(
        model="random:tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    completion = client.completions.create(model="random:tiny", prompt="Hi", max_tokens=4,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4 and completion.choices[0].text
    chat = client.chat.completions.create(model="random:tiny", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3


def test_a_burst_is_spread_over_both_replicas(cluster):
    async def one(client):
        body = {"prompt": "spread me", "max_tokens": 32, "ignore_eos": True, "stream": True}
        async with client.stream("POST", cluster["url"] + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            text = await response.aread()
            assert text.endswith(b"data: [DONE]\n\n")
            return response.headers["x-roseray-replica"]

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(8)))

    counts = collections.Counter(asyncio.run(burst()))
    assert len(counts) == 2 and min(counts.values()) >= 3, counts


def test_requests_that_skip_the_router_are_refused(cluster):
    body = {"prompt": "sneaky", "max_tokens": 2}
    for _, port in cluster["engines"]:
        direct = f"http://127.0.0.1:{port}"
        for headers in ({}, {"x-request-id": "r1", "x-serve-router-roseray-ticket": "v1.99999999999.00"}):
            refused = httpx.post(direct + "/v1/completions", json=body, headers=headers, timeout=10)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "not_routed"
        assert httpx.get(direct + "/health", timeout=10).status_code == 200  # probes stay open
    # Serve's own proxy (HAProxy's fallback when it does not know the routed replica yet)
    # routes through roseray's RequestRouter too, so the engine takes its requests
    fallback = httpx.post(f"http://127.0.0.1:{cluster['fallback_port']}/v1/completions", json=body, timeout=30)
    assert fallback.status_code == 200, fallback.text
    # a client-sent ticket header does not survive HAProxy: the router's replaces it
    routed = httpx.post(cluster["url"] + "/v1/completions", json=body, timeout=30,
                        headers={"x-serve-router-roseray-ticket": "v1.99999999999.00"})
    assert routed.status_code == 200


def engine_metrics(cluster) -> dict:
    """{replica name: {metric: value}} read from each engine replica's own port."""
    result = {}
    for _, port in cluster["engines"]:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        values = {}
        for line in response.text.split("\n"):
            if line.startswith("roseray:") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        result[response.headers["x-roseray-replica"]] = values
    return result


def test_nearly_full_kv_and_long_queue_steer_requests(cluster):
    """Replica X runs one request that holds most of its KV blocks; replica Y runs two
    small ones (a longer queue, but free blocks). A request that X cannot hold goes to Y,
    although ranking by queue alone would pick X. Then every client disconnects
    mid-stream, and both replicas free all their blocks before the requests could have
    finished on their own."""
    url = cluster["url"] + "/v1/completions"
    before = engine_metrics(cluster)
    client = httpx.Client(timeout=60)
    streams = []

    def open_stream(prompt: str, max_tokens: int) -> str:
        cm = client.stream("POST", url, json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                                              "stream": True})
        response = cm.__enter__()
        lines = response.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        streams.append((cm, lines))
        return response.headers["x-roseray-replica"]

    try:
        # 1000 + 1040 tokens: 63 of 130 blocks held from the first step, 128 at the end
        big = open_stream("a" * 1000, 1040)
        # two small requests on the other replica, Y: (20 + 700) / 16 = 45 blocks each at most. The Router
        # sends them there (X's free blocks, both queues) unless a stats snapshot of X lands between the
        # big request's pick and its arrival, which a starved CI machine can stretch; then try again.
        smalls = set()
        for _ in range(6):
            replica = open_stream("b" * 20, 700)
            if replica != big:
                smalls.add(replica)
            else:
                streams.pop()[0].__exit__(None, None, None)
                time.sleep(STATS_PERIOD_S)
            if len(streams) == 3:  # the big one and two small ones
                break
        assert len(streams) == 3 and len(smalls) == 1, (big, smalls)
        time.sleep(4 * STATS_PERIOD_S)  # fresh snapshots of both replicas, taken after the picks reached them
        # 20 + 1100 tokens = 70 blocks: more than X has left, fewer than Y has; X has the shorter queue
        assert open_stream("c" * 20, 1100) in smalls
        metrics = engine_metrics(cluster)
        assert metrics[big]["roseray:num_requests_running"] >= 1, "the big request ended before the test did"
        assert metrics[next(iter(smalls))]["roseray:num_requests_running"] >= 3
    finally:
        for cm, _ in streams:
            cm.__exit__(None, None, None)  # disconnect mid-stream
        client.close()
    deadline = time.monotonic() + 1.0
    while True:
        metrics = engine_metrics(cluster)
        if all(m["roseray:num_requests_running"] == 0 and m["roseray:num_kv_blocks_free"] == m[
                "roseray:num_kv_blocks_total"] for m in metrics.values()):
            break
        assert time.monotonic() < deadline, f"blocks not freed after disconnects: {metrics}"
        time.sleep(0.05)
    generated = {name: metrics[name]["roseray:generation_tokens_total"] - before[name]["roseray:generation_tokens_total"]
                 for name in metrics}
    assert generated[big] < 1040, generated  # aborted, not run to max_tokens
    assert generated[next(iter(smalls))] < 2 * 700 + 1100, generated


def test_haproxy_side_ports_listen_on_loopback_only(cluster):
    node_ips = {ip for ip, _ in cluster["engines"]} - {"127.0.0.1"}
    for port in (cluster["stats_port"], cluster["metrics_port"]):
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        for ip in node_ips:
            with pytest.raises(OSError):
                socket.create_connection((ip, port), timeout=5).close()


if __name__ == "__main__":
    run_cluster(json.loads(sys.argv[1]))
