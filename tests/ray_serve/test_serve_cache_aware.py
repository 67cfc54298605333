"""router.policy cache_aware end to end (Ray, two CPU replicas of random:tiny): requests that
share a long prefix go to the replica whose prefix cache holds it (the engine reports it:
their usage shows the prefix as cached tokens), also once the Router's memory of its own
picks has lapsed, so that the replica's KV events are what keeps them there; once that
replica is gone, they settle on another and stay there. The Router's /metrics dates its view of
the chosen replica's cache at each pick."""

import re
import time

import httpx
import pytest

from tests.conftest import RAY_STATS_PERIOD_S, RayServeCluster
from tests.ray_serve.helpers import router_ports, wait_for_routing
from tests.waiting import wait_until

PREFIX = "".join(chr(97 + (i * 7) % 26) for i in range(800))  # 50 blocks of the byte tokenizer
PREFIX_TOKENS = len(PREFIX) // 16 * 16


@pytest.fixture(scope="module")
def cluster():
    cluster = RayServeCluster({"router": {"policy": "cache_aware", "stats_period_s": RAY_STATS_PERIOD_S,
                                          "kv_snapshot_every": 4}})
    try:
        cluster.wait_ready()
        wait_for_routing(cluster.url)
        yield cluster
    finally:
        cluster.close()


def complete(url: str, prompt: str) -> tuple[str, int]:
    """(the replica that served it, its prompt tokens served from the prefix cache)."""
    response = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text
    cached = response.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return response.headers["x-roseray-replica"], cached


PICK_CACHE_S = 2.0  # RoutingPolicy's default pick_cache_s


def stays_on_one_replica(url: str, rounds: int = 4) -> str:
    holder, _ = complete(url, PREFIX + " first")
    # the Router counts its own pick of the prefix as cached for PICK_CACHE_S; past it only the
    # holder's KV events (two stats periods at most) say where the prefix is. Nothing outside the
    # Router shows when its memory lapses: this waits it out.
    time.sleep(PICK_CACHE_S + 4 * RAY_STATS_PERIOD_S)
    for i in range(rounds):
        complete(url, f"unrelated {i} " * 8)
        replica, cached = complete(url, PREFIX + f" q{i}")
        assert replica == holder and cached >= PREFIX_TOKENS - 16, (i, replica, holder, cached)
    return holder


def view_age_samples(router_port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{router_port}/metrics", timeout=10).text
    samples = {}
    for name, labels, value in re.findall(r'^(roseray:router_kv_view_age_seconds_\w+)\{([^}]*)\} (\S+)$', text, re.M):
        le = re.search(r'le="([^"]+)"', labels)
        samples[name + (le.group(1) if le else "")] = float(value)
    return samples


def test_the_router_reports_the_age_of_its_cache_view_at_each_pick(cluster):
    """Picks made on a view of the chosen replica's cache (KV events have arrived) are
    observed in roseray:router_kv_view_age_seconds, every one of them younger than a
    generous bound (the view is a stats period or two old)."""
    router_port = min(router_ports(cluster.state_dir))
    count = "roseray:router_kv_view_age_seconds_count"
    start = view_age_samples(router_port).get(count, 0.0)

    def observed() -> bool:
        complete(cluster.url, f"view age {time.monotonic()} " * 4)
        return view_age_samples(router_port)[count] >= start + 5

    wait_until(observed, timeout=60, interval=0.05, message=lambda: view_age_samples(router_port))
    samples = view_age_samples(router_port)
    assert samples["roseray:router_kv_view_age_seconds_bucket5.0"] == samples[count]  # none older than 5 s
    assert samples["roseray:router_kv_view_age_seconds_sum"] > 0.0


def test_a_shared_prefix_goes_to_its_holder_until_the_holder_goes(cluster):
    holder = stays_on_one_replica(cluster.url)
    cluster.command("kill", replica=holder.split("#", 1)[1])

    def served_again() -> bool:  # HAProxy and the Router learn that the replica left
        try:
            return complete(cluster.url, "after the kill")[0] != holder
        except (httpx.HTTPError, AssertionError):
            return False

    wait_until(served_again, timeout=60, interval=0.1, message=lambda: cluster.log_tail())
    assert stays_on_one_replica(cluster.url) != holder
