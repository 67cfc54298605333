"""An engine replica's actor killed under load (issue 6), on the session's Ray Serve cluster
(tests/conftest.py: two CPU replicas of random:tiny behind HAProxy and the Router).

The replica is found through Serve's API (the controller's instance details) and killed
with `ray.kill(..., no_restart=True)`, as after a crash or an OOM kill; ray.kill only asks
the actor's worker to exit, so the cluster's kill op returns once the process has gone. Then:
  * its in-flight streams end with a clear error: HAProxy cuts the client connection in
    the middle of the chunked body, which every HTTP client reports as an error (httpx:
    "incomplete chunked read"); none of them ends like a complete answer ([DONE], a
    finish_reason). A killed process cannot write an SSE error event; a replica that is
    stopped gracefully does (tests/test_hardening_faults.py, the drain tests);
  * the streams on the other replica finish in full;
  * Serve starts a replacement; the Router stops sending requests to the dead replica at
    once and sends them to the new one when it is up; every new request is answered, even
    in the first milliseconds (a request whose connection the dying replica accepted but
    never answered is retried by HAProxy on another replica: roseray.ray_serve.haproxy_env);
  * the survivor's KV accounting has not drifted: its integrity check passes, all its
    blocks are free, and so are the replacement's.
"""

import concurrent.futures
import json
import threading
import time

import httpx
import pytest

from tests.ray_serve.helpers import wait_for_routing
from tests.waiting import wait_until

pytestmark = pytest.mark.ray

LONG_TOKENS = 1500  # a few seconds per stream on CPU: still running when the replica dies


class Stream:
    """A long streamed completion read on a thread; `events` grows as tokens arrive."""

    def __init__(self, url: str, i: int) -> None:
        self.body = {"prompt": f"replica fault {i}", "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True,
                     "temperature": 0}
        self.url = url
        self.replica: str | None = None
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.started = threading.Event()

    def run(self) -> "Stream":
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=60) as response:
                assert response.status_code == 200, response.read()
                self.replica = response.headers["x-roseray-replica"]
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.started.set()
        except Exception as error:  # noqa: BLE001 - what the client sees is the point of the test
            self.error = error
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
        return self

    @property
    def complete(self) -> bool:
        if len(self.events) < 2 or self.events[-1] != "[DONE]":
            return False
        return json.loads(self.events[-2])["choices"][0]["finish_reason"] == "length"


def test_killing_an_engine_replica_under_load(ray_serve_cluster):
    cluster = ray_serve_cluster
    wait_for_routing(cluster.url)
    before = {r["replica_id"]: r for r in cluster.command("replicas")}
    assert len(before) == 2 and all(r["state"] == "RUNNING" for r in before.values()), before

    pool = concurrent.futures.ThreadPoolExecutor(24)
    streams = [Stream(cluster.url, i) for i in range(8)]
    futures = [pool.submit(s.run) for s in streams]
    wait_until(lambda: all(len(s.events) >= 5 for s in streams) and len({s.replica for s in streams}) == 2,
               timeout=30, interval=0.05, message=lambda: f"{[(s.replica, len(s.events), s.error) for s in streams]}")
    victim = streams[0].replica.split("#", 1)[1]
    killed_at = time.monotonic()
    cluster.command("kill", replica=victim)

    # a burst at once: Serve has not noticed the death yet, so the Router may still pick the dead
    # replica, and a connection HAProxy holds to it closes without an answer; HAProxy retries those
    # on another replica (the wrapper's retry-on conn-failure and empty-response), so the client gets
    # a 200, not Serve's plain 500
    burst = list(pool.map(lambda i: httpx.post(cluster.url + "/v1/completions", timeout=30,
                                                json={"prompt": f"burst {i}", "max_tokens": 4}), range(12)))
    assert [r.status_code for r in burst] == [200] * len(burst), [(r.status_code, r.text[:80]) for r in burst]
    assert not any(r.headers["x-roseray-replica"] == f"Engine#{victim}" for r in burst)

    # new requests while Serve heals: every one is answered, none by the dead replica
    answered, replacement = [], [None]

    def replacement_took_traffic() -> bool:  # one request a call, every 0.1 s
        response = httpx.post(cluster.url + "/v1/completions", json={"prompt": f"during {len(answered)}",
                                                                     "max_tokens": 4}, timeout=30)
        assert response.status_code == 200, (time.monotonic() - killed_at, response.status_code, response.text)
        answered.append((time.monotonic() - killed_at, response.headers["x-roseray-replica"]))
        if replacement[0] is None and len(answered) % 5 == 0:
            running = {r["replica_id"] for r in cluster.command("replicas") if r["state"] == "RUNNING"}
            new = running - set(before)
            replacement[0] = f"Engine#{new.pop()}" if new else None
        return replacement[0] is not None and sum(1 for _, r in answered if r == replacement[0]) >= 3

    wait_until(replacement_took_traffic, timeout=60, interval=0.1,
               message=lambda: f"a replacement took traffic: {answered[-5:]}")
    assert not any(replica == f"Engine#{victim}" for _, replica in answered), answered

    for future in futures:
        future.result(timeout=60)
    on_victim = [s for s in streams if s.replica == f"Engine#{victim}"]
    on_survivor = [s for s in streams if s.replica != f"Engine#{victim}"]
    assert on_victim and on_survivor
    for s in on_victim:  # cut mid-body: an error to the client, never a complete-looking answer
        assert isinstance(s.error, httpx.RemoteProtocolError) and "incomplete chunked read" in str(s.error), s.error
        assert not s.complete and "[DONE]" not in s.events
        assert s.ended_at - killed_at < 10
    for s in on_survivor:  # no collateral damage
        assert s.error is None and s.complete, (s.error, s.events[-2:])
        assert len(s.events) == LONG_TOKENS + 1  # one event per token, then [DONE]

    after = {r["replica_id"]: r for r in cluster.command("replicas")}
    assert victim not in after and len(after) == 2 and all(r["state"] == "RUNNING" for r in after.values()), after
    integrity = cluster.command("integrity")  # EngineDeployment.check_integrity on each replica's engine thread
    assert set(integrity) == {f"Engine#{rid}" for rid in after}, integrity
    for counts in integrity.values():
        assert counts["num_free_blocks"] == counts["num_total_blocks"] and counts["num_running"] == 0, integrity
    for _, port in cluster.engines():  # and what each replica's own /metrics says
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        free = next(line for line in metrics.split("\n") if line.startswith("roseray:num_kv_blocks_free"))
        total = next(line for line in metrics.split("\n") if line.startswith("roseray:num_kv_blocks_total"))
        assert free.split()[-1] == total.split()[-1], (free, total)
    pool.shutdown()
