"""The Ray Serve app on two Ray nodes (tests/ray_serve/two_node_cluster.py: a head and a worker, each
`ray start`ed on this machine, one engine replica pinned to each by a custom resource), traffic through
the head's HAProxy: both replicas serve and the Router balances over them; then the worker node is lost
(every process of it SIGKILLed), which cuts its streams (no error event: the process that would write
one is gone; deploy/README.md says so), the Router stops sending there, and the app keeps serving from
the head.

This module uses no shared fixture: its cluster is its own, started and stopped here (the shared
cluster of tests/conftest.py runs after the modules that do not ask for it)."""

import asyncio
import collections
import time

import httpx
import pytest

from tests.ray_serve.helpers import wait_for_routing
from tests.ray_serve.two_node_cluster import HEALTH_CHECK_FAILURES, HEALTH_CHECK_PERIOD_MS, TwoNodeCluster
from tests.waiting import wait_until

pytestmark = pytest.mark.ray

# From the loss of the worker node until the Router picks only the head's replica: the GCS declares the
# node dead after HEALTH_CHECK_FAILURES missed checks, then Serve's controller drops its replica and
# tells the Router (its long poll); the rest is a loaded 2-core machine's slack. Measured on a 2-core box:
# the first request after the loss, 0.1-0.4 s later, already went to the head (without the loss the Router
# sends every other request to the worker's replica, whose queue is shorter).
ROUTER_FORGETS_S = HEALTH_CHECK_FAILURES * HEALTH_CHECK_PERIOD_MS / 1000 + 2 + 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = TwoNodeCluster(tmp_path_factory.mktemp("two_nodes"))
    try:
        nodes.start()
        placement = nodes.deploy()
        wait_for_routing(nodes.url)
        yield nodes, placement
    finally:
        nodes.close()


def stream(client: httpx.Client, url: str, max_tokens: int):
    """An open completion stream, its first line read: (context manager, line iterator, replica)."""
    cm = client.stream("POST", url + "/v1/completions",
                       json={"prompt": "two nodes", "max_tokens": max_tokens, "ignore_eos": True, "stream": True})
    response = cm.__enter__()
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")
    return cm, lines, response.headers["x-roseray-replica"].split("#", 1)[1]


def rest_of(lines) -> tuple[list[str], str | None]:
    """The stream's remaining lines, and the transport error that cut it (None: it ended cleanly)."""
    seen = []
    try:
        for line in lines:
            seen.append(line)
    except httpx.HTTPError as error:
        return seen, type(error).__name__
    return seen, None


def test_two_nodes_serve_balance_and_survive_losing_the_worker(cluster):
    nodes, placement = cluster
    assert sorted(placement.values()) == ["head", "worker"], placement  # one replica per node
    worker_replica = next(r for r, node in placement.items() if node == "worker")
    head_replica = next(r for r, node in placement.items() if node == "head")

    # both replicas serve through the head's HTTP port, and the Router spreads a burst over them
    async def one(client):
        body = {"prompt": "spread me", "max_tokens": 24, "ignore_eos": True, "stream": True}
        async with client.stream("POST", nodes.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert (await response.aread()).endswith(b"data: [DONE]\n\n")
            return response.headers["x-roseray-replica"].split("#", 1)[1]

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(8)))

    counts = collections.Counter(asyncio.run(burst()))
    assert set(counts) == set(placement) and min(counts.values()) >= 2, counts

    # long streams: two on the head's replica, one on the worker's (which the Router would then prefer, had it
    # not learnt of the loss); then the worker node is lost
    client = httpx.Client(timeout=60)
    want = {head_replica: 2, worker_replica: 1}
    streams = collections.defaultdict(list)
    try:
        for _ in range(16):
            cm, lines, replica = stream(client, nodes.url, 600)
            if len(streams[replica]) < want[replica]:
                streams[replica].append((cm, lines))
            else:
                cm.__exit__(None, None, None)
            if all(len(streams[r]) == n for r, n in want.items()):
                break
        assert all(len(streams[r]) == n for r, n in want.items()), {r: len(v) for r, v in streams.items()}
        assert nodes.stop_worker()
        lost_at = time.monotonic()
        worker_lines, worker_cut = rest_of(streams[worker_replica][0][1])
        # the stream is cut: HAProxy's chunked body to the client stops short, which httpx reports
        # (RemoteProtocolError), so a client can tell it from a finished stream; no error event, since the process
        # that would write one is gone; never [DONE]
        assert "data: [DONE]" not in worker_lines, worker_lines[-3:]
        assert not [line for line in worker_lines if line.startswith('data: {"error"')], worker_lines[-3:]
        assert worker_cut is not None, f"the lost node's stream ended like a finished one: {worker_lines[-3:]}"
        wait_for_only_head(nodes.url, head_replica, lost_at)
        for _, lines in streams[head_replica]:  # the head's streams were not disturbed
            head_lines, head_cut = rest_of(lines)
            assert head_cut is None and "data: [DONE]" in head_lines, (head_cut, head_lines[-3:])
        print(f"the lost node's stream: cut ({worker_cut}) after {len(worker_lines)} lines")
    finally:
        for opened in streams.values():
            for cm, _ in opened:
                try:
                    cm.__exit__(None, None, None)
                except httpx.HTTPError:
                    pass
        client.close()


def wait_for_only_head(url: str, head_replica: str, lost_at: float) -> None:
    """Requests from the loss on until eight in a row went to the head's replica; the first of those eight
    within ROUTER_FORGETS_S of the loss, and none of them all failed (the app keeps serving)."""
    outcomes = []

    def only_head_now() -> bool:
        try:
            response = httpx.post(url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=20)
            replica = response.headers.get("x-roseray-replica", "").split("#", 1)[-1]
            outcomes.append((round(time.monotonic() - lost_at, 2), response.status_code, replica))
        except httpx.HTTPError as error:
            outcomes.append((round(time.monotonic() - lost_at, 2), type(error).__name__, ""))
        recent = outcomes[-8:]
        return len(recent) == 8 and all(status == 200 and replica == head_replica for _, status, replica in recent)

    wait_until(only_head_now, timeout=ROUTER_FORGETS_S + 30, interval=0.05,
               message=lambda: f"only the head's replica serves; outcomes since the loss: {outcomes[-20:]}")
    settled_at = outcomes[-8][0]  # the first of the eight in a row
    assert settled_at <= ROUTER_FORGETS_S, f"the Router forgot the lost replica after {settled_at} s: {outcomes}"
    assert all(status == 200 for _, status, _ in outcomes), f"requests failed after the loss: {outcomes}"
    print(f"lost replica forgotten after {settled_at} s; outcomes since the loss: {outcomes}")
