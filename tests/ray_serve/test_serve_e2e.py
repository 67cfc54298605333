"""The Ray Serve app end to end: a local Ray cluster in HAProxy mode, serve_config.yaml's
app with two CPU engine replicas of random:tiny, traffic through HAProxy and the Router.

The cluster is the session's (tests/conftest.py: ray_serve_cluster), shared with
tests/ray_serve/test_hardening_ray.py and tests/bench/test_locust.py; its replica list is read when this
module starts (a test before may have replaced a replica)."""

import asyncio
import collections
import json
import socket
import time

import httpx
import jsonschema
import pytest

from tests.conftest import RAY_STATS_PERIOD_S as STATS_PERIOD_S
from tests.ray_serve.helpers import wait_for_routing
from tests.waiting import wait_until

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(ray_serve_cluster):
    wait_for_routing(ray_serve_cluster.url)
    return {"url": ray_serve_cluster.url, "engines": ray_serve_cluster.engines(),
            "stats_port": ray_serve_cluster.stats_port, "metrics_port": ray_serve_cluster.metrics_port,
            "fallback_port": ray_serve_cluster.fallback_port}


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


def kv_blocks_all_free(metrics: dict) -> bool:
    return all(m["roseray:num_requests_running"] == 0
               and m["roseray:num_kv_blocks_free"] == m["roseray:num_kv_blocks_total"] for m in metrics.values())


STEER_NEED_BLOCKS = 55  # the steered request: 20 + 860 tokens
# more than X's request takes in a stats period: the Router's snapshot of X may be that much older than a read
STEER_MARGIN_X_BLOCKS = 10
# more than Y's two requests take between a metrics read and the Router's pick right after it
STEER_MARGIN_Y_BLOCKS = 6


def test_nearly_full_kv_and_long_queue_steer_requests(cluster):
    """Replica X runs one request that holds most of its KV blocks; replica Y runs two
    small ones (a longer queue, but free blocks). A request that X cannot hold goes to Y,
    although ranking by queue alone would pick X. Then every client disconnects
    mid-stream, and both replicas free all their blocks before the requests could have
    finished on their own."""
    url = cluster["url"] + "/v1/completions"
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

    def disconnect() -> None:
        while streams:
            streams.pop()[0].__exit__(None, None, None)  # disconnect mid-stream

    def wait_all_free(timeout_s: float) -> dict:
        seen = [None]

        def all_free():
            seen[0] = engine_metrics(cluster)
            return seen[0] if kv_blocks_all_free(seen[0]) else None

        return wait_until(all_free, timeout=timeout_s, interval=0.05,
                          message=lambda: f"blocks freed after disconnects: {seen[0]}")

    try:
        # Every request takes another block every 16 tokens, at the machine's speed: X's request
        # holds more of X than the steered request leaves once it has run a while (waited for), and
        # Y's two requests take Y's blocks twice as fast; when they took too much of Y (or ended)
        # before the steered request could be sent, the scenario starts over.
        for _ in range(5):
            before = engine_metrics(cluster)
            # 1250 + 790 tokens: 79 of 130 blocks held from the first step (X has 51 free, fewer than the
            # steered request needs, whatever the machine's speed), 128 at the end
            big = open_stream("a" * 1250, 790)
            # two small requests on the other replica, Y: (20 + 700) / 16 = 45 blocks each at most. The
            # Router sends them there (X's free blocks, both queues) unless a stats snapshot of X lands
            # between the big request's pick and its arrival, which a starved machine can stretch; then
            # try again.
            smalls = set()
            for _ in range(6):
                replica = open_stream("b" * 20, 700)
                if replica != big:
                    smalls.add(replica)
                else:
                    streams.pop()[0].__exit__(None, None, None)
                    # the Router's next stats snapshot (not observable from here) shows the big request on X
                    time.sleep(STATS_PERIOD_S)
                if len(streams) == 3:  # the big one and two small ones
                    break
            assert len(streams) == 3 and len(smalls) == 1, (big, smalls)
            small = next(iter(smalls))
            # fresh snapshots of both replicas, taken after the picks reached them: the Router's snapshots are
            # not observable from here, so time passes for three stats periods
            time.sleep(3 * STATS_PERIOD_S)
            # free blocks only shrink while a replica's requests run, and the Router's snapshots are at most
            # a stats period older than a read: its snapshot of X shows at most the read plus the X margin,
            # its snapshot of Y at least the read less what Y takes before the pick (the Y margin)
            views = [None]

            def x_filled_or_done() -> bool:
                views[0] = engine_metrics(cluster)
                return (views[0][big]["roseray:num_kv_blocks_free"] <= STEER_NEED_BLOCKS - STEER_MARGIN_X_BLOCKS
                        or not views[0][big]["roseray:num_requests_running"])

            wait_until(x_filled_or_done, timeout=30, interval=0.02, message=lambda: f"X filled: {views[0][big]}")
            now = views[0]
            if (now[big]["roseray:num_requests_running"] >= 1 and now[small]["roseray:num_requests_running"] >= 2
                    and now[small]["roseray:num_kv_blocks_free"] >= STEER_NEED_BLOCKS + STEER_MARGIN_Y_BLOCKS):
                break
            disconnect()
            wait_all_free(10.0)
        else:
            seen = {name: (m["roseray:num_requests_running"], m["roseray:num_kv_blocks_free"])
                    for name, m in now.items()}
            # the scenario depends on the two replicas' relative speed, which a full suite run on a 2-core box
            # does not give (seen twice in clean-clone CI runs: one of Y's small requests was not running); the
            # routing rule itself is tested without timing in test_serve_routing.py
            disconnect()
            wait_all_free(10.0)
            pytest.skip(f"the scenario did not form in five tries: {seen} (running, free blocks), Y={small}")
        # 20 + 860 tokens = 55 blocks: more than X has left, fewer than Y has; X has the shorter queue
        assert open_stream("c" * 20, 860) in smalls
        metrics = engine_metrics(cluster)
        assert metrics[big]["roseray:num_requests_running"] >= 1, "the big request ended before the test did"
        assert metrics[small]["roseray:num_requests_running"] >= 3
    finally:
        disconnect()
        client.close()
    metrics = wait_all_free(1.0)
    generated = {name: metrics[name]["roseray:generation_tokens_total"]
                 - before[name]["roseray:generation_tokens_total"] for name in metrics}
    assert generated[big] < 790, generated  # aborted, not run to max_tokens
    assert generated[small] < 2 * 700 + 860, generated


def test_haproxy_side_ports_listen_on_loopback_only(cluster):
    node_ips = {ip for ip, _ in cluster["engines"]} - {"127.0.0.1"}
    for port in (cluster["stats_port"], cluster["metrics_port"]):
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        for ip in node_ips:
            with pytest.raises(OSError):
                socket.create_connection((ip, port), timeout=5).close()


def test_tool_choice_required_and_a_json_schema_through_the_router(cluster):
    """The agent API through HAProxy, the Router and an engine replica: the grammar makes the
    random model's outputs valid. (Last in the module: the burst test expects idle replicas
    whose stats the Router has seen.)"""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="unused", max_retries=0)
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    completion = client.chat.completions.create(model="random:tiny", messages=messages, tools=tools,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                                temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    answer = client.chat.completions.create(model="random:tiny", messages=messages, max_tokens=200, temperature=0,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "weather", "schema": parameters}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), parameters)
