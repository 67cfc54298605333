"""The Ray Serve app on two Ray nodes (tests/ray_serve/two_node_cluster.py: a head and a worker, each
`ray start`ed on this machine, one engine replica pinned to each by a custom resource), traffic through
the head's HAProxy: both replicas serve and the Router balances over them; then the worker node is lost
(every process of it SIGKILLed), which cuts its streams (no error event: the process that would write
one is gone; deploy/README.md says so), the Router stops picking its replica once that replica's routing
stats stop coming (stats_freshness.py), before Ray declares the node dead, and the app keeps serving
from the head.

This module uses no shared fixture: its cluster is its own, started and stopped here (the shared
cluster of tests/conftest.py runs after the modules that do not ask for it)."""

import asyncio
import collections
import glob
import os
import re
import time
import uuid

import httpx
import pytest

from roseray.ray_serve.stats_freshness import stale_after_s
from tests.ray_serve.helpers import router_ports, wait_for_routing
from tests.ray_serve.two_node_cluster import HEALTH_CHECK_FAILURES, HEALTH_CHECK_PERIOD_MS, TwoNodeCluster, app_args
from tests.waiting import wait_until

pytestmark = pytest.mark.ray

# From the loss of the worker node until the Router picks only the head's replica: its latest stats arrived
# at most a moment after the loss (a pull answered just before it, delivered at the controller's next tick:
# the slack's first part), and the Router sets the replica aside stale_after_s(stats period) after that
# (1.0 s at the test's 0.25 s period); the rest of the slack is a probe's round trip on a loaded 2-core box.
# Ray itself drops the replica only once the GCS declares the node dead: at least RAY_DETECTS_S after the loss
# (its first failed health check may come at once).
STATS_PERIOD_S = app_args()["router"]["stats_period_s"]
ROUTER_SETS_ASIDE_S = stale_after_s(STATS_PERIOD_S) + 0.5
RAY_DETECTS_S = (HEALTH_CHECK_FAILURES - 1) * HEALTH_CHECK_PERIOD_MS / 1000
assert ROUTER_SETS_ASIDE_S < RAY_DETECTS_S, "the test would not tell the Router's rule from Ray's detection"


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

    # long streams: five on the head's replica, one on the worker's, which the Router keeps preferring (by its
    # last stats, plus the few picks it makes there meanwhile) until it sets that replica aside; then the worker
    # node is lost
    client = httpx.Client(timeout=60)
    want = {head_replica: 5, worker_replica: 1}
    streams = collections.defaultdict(list)
    router_port = min(router_ports(nodes.state_dir))  # one Router (two_node_cluster.py)
    try:
        for _ in range(64):
            cm, lines, replica = stream(client, nodes.url, 600)
            if len(streams[replica]) < want[replica]:
                streams[replica].append((cm, lines))
            else:
                cm.__exit__(None, None, None)
            if all(len(streams[r]) == n for r, n in want.items()):
                break
        assert all(len(streams[r]) == n for r, n in want.items()), {r: len(v) for r, v in streams.items()}
        # the Router prefers the worker's replica now (its picks from the loop above have reached the stats)
        wait_until(lambda: route(router_port) == worker_replica, timeout=20, interval=0.1,
                   message="the Router picks the worker's replica, whose queue is shorter")
        assert nodes.stop_worker()
        lost_at = time.monotonic()
        worker_lines, worker_cut = rest_of(streams[worker_replica][0][1])
        # the stream is cut: HAProxy's chunked body to the client stops short, which httpx reports
        # (RemoteProtocolError), so a client can tell it from a finished stream; no error event, since the process
        # that would write one is gone; never [DONE]
        assert "data: [DONE]" not in worker_lines, worker_lines[-3:]
        assert not [line for line in worker_lines if line.startswith('data: {"error"')], worker_lines[-3:]
        assert worker_cut is not None, f"the lost node's stream ended like a finished one: {worker_lines[-3:]}"
        # the Router's own picks from ROUTER_SETS_ASIDE_S after the loss on (the time to wait for, not a condition):
        # the head's only. Without the rule it would still pick the worker (1 stream + 1 or 2 picks < 5) until Ray
        # drops it
        time.sleep(max(0.0, lost_at + ROUTER_SETS_ASIDE_S - time.monotonic()))
        picks = []
        for _ in range(10):
            picks.append((round(time.monotonic() - lost_at, 2), route(router_port)))
            time.sleep(0.05)
        assert all(replica == head_replica for _, replica in picks), picks
        # ... because its stats stopped coming: the Router says so, and says how old they were at the first pick
        age = wait_until(lambda: set_aside_age(nodes, worker_replica), timeout=20, interval=0.2,
                         message=lambda: f"the Router's log: the worker's replica set aside; picks {picks}; "
                                         f"log lines naming it: {log_lines(nodes, worker_replica)[-12:]}")
        set_aside_at = picks[0][0] - age + stale_after_s(STATS_PERIOD_S)
        assert set_aside_at <= ROUTER_SETS_ASIDE_S, (set_aside_at, age, picks)
        # through HAProxy: every request served, by the head
        served = [serve_one(nodes.url) for _ in range(8)]
        assert all(outcome == (200, head_replica) for outcome in served), served
        for _, lines in streams[head_replica]:  # the head's streams were not disturbed
            head_lines, head_cut = rest_of(lines)
            assert head_cut is None and "data: [DONE]" in head_lines, (head_cut, head_lines[-3:])
        print(f"the lost node's stream: cut ({worker_cut}) after {len(worker_lines)} lines; the worker's stats were "
              f"{age:.2f} s old at {picks[0][0]} s: set aside {set_aside_at:.2f} s after the loss "
              f"(bound {ROUTER_SETS_ASIDE_S:.2f} s); the head's replica set aside "
              f"{len([line for line in log_lines(nodes, head_replica) if 'sent no routing stats' in line])} times")
    finally:
        for opened in streams.values():
            for cm, _ in opened:
                try:
                    cm.__exit__(None, None, None)
                except httpx.HTTPError:
                    pass
        client.close()


def route(port: int) -> str:
    """The replica the Router picks (its POST /internal/route, as HAProxy's Lua asks it), by its unique id."""
    response = httpx.post(f"http://127.0.0.1:{port}/internal/route", headers={"x-request-id": uuid.uuid4().hex},
                          json={"prompt": "after", "max_tokens": 2}, timeout=20)
    assert response.status_code == 200, response.text
    return response.json()["replica_id"].rsplit("#", 1)[-1]


def serve_one(url: str) -> tuple:
    try:
        response = httpx.post(url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=20)
    except httpx.HTTPError as error:
        return type(error).__name__, ""
    return response.status_code, response.headers.get("x-roseray-replica", "").split("#", 1)[-1]


def set_aside_age(nodes: TwoNodeCluster, replica: str) -> float | None:
    """How old the replica's stats were when the Router set it aside (stats_freshness.py's warning, in the
    Router's log on the head), or None before that line is written."""
    pattern = re.compile(re.escape(replica) + r".* sent no routing stats for ([0-9.]+) s")
    found = [match for line in log_lines(nodes, replica) if (match := pattern.search(line))]
    return float(found[0].group(1)) if found else None


def log_lines(nodes: TwoNodeCluster, text: str) -> list[str]:
    """The lines of the head's Ray logs that contain `text`: (file name, line)."""
    lines = []
    for path in glob.glob(os.path.join(nodes.head_tmp, "session_*", "logs", "**", "*"), recursive=True):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                lines += [f"{os.path.basename(path)}: {line.rstrip()}" for line in f if text in line]
    return lines
