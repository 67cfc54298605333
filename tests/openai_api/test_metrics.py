"""Request metrics: the hand-rolled ITL histogram exports exactly what prometheus_client's
Histogram would; every request is counted once in request_success by how it ended, a
client that went away (streamed or whole) as "abort"."""

import json
import socket

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from roseray.config import EngineConfig
from roseray.openai_api.metrics import BisectHistogram
from tests.openai_api.helpers import MODEL, serving, wait_until_idle
from tests.waiting import wait_until

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.1, 1.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.001, 0.0025, 0.003, 0.01, 0.5, 1.0, 7.0]), st.integers(1, 4)),
                max_size=30))
def test_token_gap_histogram_matches_prometheus_client(observations):
    ours_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    ours = BisectHistogram("itl_seconds", "gaps", "m", BUCKETS)
    ours_registry.register(ours)
    reference = Histogram("itl_seconds", "gaps", ["model_name"], buckets=BUCKETS,
                          registry=reference_registry).labels("m")
    for value, count in observations:
        ours.observe(value, count)
        for _ in range(count):
            reference.observe(value)
    strip = lambda text: sorted(line for line in text.decode().split("\n") if line and "_created" not in line)  # noqa: E731
    ours_lines, reference_lines = strip(generate_latest(ours_registry)), strip(generate_latest(reference_registry))
    sums = [line for line in ours_lines if "_sum" in line], [line for line in reference_lines if "_sum" in line]
    assert [l for l in ours_lines if "_sum" not in l] == [l for l in reference_lines if "_sum" not in l]
    assert abs(float(sums[0][0].split()[-1]) - float(sums[1][0].split()[-1])) < 1e-9


# ---- request_success by finish reason ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    # slow steps: a long request is still running when its client leaves
    with serving(EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=512, max_num_seqs=4),
                 step_delay_s=0.005) as s:
        yield s


def finished(client: httpx.Client) -> dict[str, float]:
    """request_success_total by finished_reason, from /metrics."""
    counts = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "roseray:request_success_total":
                counts[sample.labels["finished_reason"]] = sample.value
    return counts


def wait_for_count(client: httpx.Client, reason: str, value: float, timeout_s: float = 10.0) -> dict[str, float]:
    seen = [None]

    def counted():
        seen[0] = finished(client)
        return seen[0] if seen[0].get(reason) == value else None

    return wait_until(counted, timeout=timeout_s,
                      message=lambda: f"request_success_total{{finished_reason={reason!r}}} == {value}: {seen[0]}")


LONG = {"prompt": "a long one", "max_tokens": 450, "ignore_eos": True}


def test_a_streamed_request_left_by_its_client_is_counted_as_abort(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        before = finished(client)
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            next(lines)
            assert server.engine.stats.num_running == 1
        # leaving the block closed the connection mid-stream
        counts = wait_for_count(client, "abort", before["abort"] + 1)
        wait_until_idle(server.engine)
        assert {k: v for k, v in counts.items() if k != "abort"} == {k: v for k, v in before.items() if k != "abort"}


def test_a_whole_request_left_by_its_client_is_counted_as_abort(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        before = finished(client)
        engine = server.engine
        tokens = engine.stats.generation_tokens_total
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            body = json.dumps(LONG).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            wait_until(lambda: engine.stats.generation_tokens_total >= tokens + 2, message="generating")
        counts = wait_for_count(client, "abort", before["abort"] + 1)
        wait_until_idle(engine)
        assert counts["length"] == before["length"] and counts["stop"] == before["stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_finishes_is_counted_once_by_its_reason(server, stream):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        before = finished(client)
        response = client.post("/v1/completions", json={"prompt": "short", "max_tokens": 3, "ignore_eos": True,
                                                        "stream": stream})
        assert response.status_code == 200
        counts = wait_for_count(client, "length", before["length"] + 1)
        wait_until_idle(server.engine)  # the connection is done with: nothing more is counted
        assert finished(client) == counts and counts["abort"] == before["abort"]
