"""`roseray serve --api-processes 2`, as real processes on CPU (random:tiny): streams
spread over both API processes and come out right, /metrics from either process counts
every request, a client that goes away frees its KV blocks in the shared engine, SIGTERM
or SIGINT ends every process cleanly and quietly, and a dead API process takes the server down (exit 1, no
orphan engine)."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile

import httpx
import pytest

from tests.conftest import free_port
from tests.openai_api.helpers import metric, sse_events
from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIDS = re.compile(r"2 API processes on 127\.0\.0\.1:\d+ \(pids (\d+) (\d+)\), one engine process \(pid (\d+)\)")


class Server:
    """A `roseray serve --api-processes 2` process, its log and its children's pids."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="roseray-api-processes-", suffix=".log")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "roseray.cli", "serve", "--model", "random:tiny", "--port", str(self.port),
             "--api-processes", "2", "--num-kv-blocks", "256", "--max-model-len", "2048", "--max-num-seqs", "64",
             "--drain-timeout", "2"], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.num_requests = 0  # generation requests that finished, for the metrics test
        ready = set()  # the API processes that answered /ready (each listens once its app is up)

        def both_ready():
            assert self.process.poll() is None, self.output()
            match = PIDS.search(self.output())
            if match:
                try:
                    r = httpx.get(self.url + "/ready", timeout=2)  # a new connection: either process
                    if r.status_code == 200:
                        ready.add(r.headers["x-roseray-replica"].rpartition("/")[2])
                except httpx.HTTPError:
                    pass
            return match if ready == {"api0", "api1"} else None

        match = wait_until(both_ready, timeout=90, interval=0.05,
                           message=lambda: "the server did not become ready:\n" + self.output())
        self.worker_pids = [int(match.group(1)), int(match.group(2))]
        self.engine_pid = int(match.group(3))

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def pids(self) -> list[int]:
        return [self.process.pid, *self.worker_pids, self.engine_pid]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in self.pids():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone but for its parent's wait
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout=timeout_s, interval=0.05,
               message=lambda: f"still alive: {[pid for pid in pids if alive(pid)]}")


@pytest.fixture(scope="module")
def server():
    server = Server()
    yield server
    server.stop()


def test_concurrent_streams_complete_on_both_api_processes(server):
    prompts = [f"prompt number {i}" for i in range(6)]
    expected = {}
    for prompt in prompts:  # the whole text of each, greedy, as the reference
        body = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0.0}).json()
        expected[prompt] = body["choices"][0]["text"]
        server.num_requests += 1

    async def one(client: httpx.AsyncClient, prompt: str):
        body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        response = await client.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        events = sse_events(response.text)
        text = "".join(c["text"] for e in events for c in e["choices"])
        return prompt, text, events[-1]["usage"]["completion_tokens"], response.headers["x-roseray-replica"]

    async def all_streams():
        # a connection per stream: the kernel spreads connections over the two processes
        clients = [httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) for _ in range(48)]
        try:
            return await asyncio.gather(*[one(c, prompts[i % len(prompts)]) for i, c in enumerate(clients)])
        finally:
            await asyncio.gather(*[c.aclose() for c in clients])

    results = asyncio.run(all_streams())
    server.num_requests += len(results)
    for prompt, text, completion_tokens, _ in results:
        assert text == expected[prompt] and completion_tokens == 12
    assert {replica.rsplit("/", 1)[1] for *_, replica in results} == {"api0", "api1"}


def test_metrics_count_every_request_whichever_process_answers(server):
    for i in range(5):
        response = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 3, "ignore_eos": True})
        assert response.status_code == 200
        server.num_requests += 1
    # the other process's part is up to 1 s old
    wait_until(lambda: metric(httpx.get(server.url + "/metrics", timeout=10).text,
                              "roseray:request_success_total") == server.num_requests,
               timeout=5, interval=0.05, message=f"{server.num_requests} requests counted")
    # every process counts every request once its siblings' latest snapshots are in (<= 1 s):
    # until then a scrape may lag by the requests a sibling served since its last write
    answered = set()

    def both_count_every_request():
        response = httpx.get(server.url + "/metrics", timeout=10)  # a new connection: either process
        counts = [metric(response.text, name) for name in ("roseray:request_success_total",
                  "roseray:e2e_request_latency_seconds_count", 'roseray:e2e_request_latency_seconds_bucket{le="+Inf"')]
        if counts == [server.num_requests] * 3:
            answered.add(response.headers["x-roseray-replica"].rsplit("/", 1)[1])
        else:
            assert all(c <= server.num_requests for c in counts), counts  # never counted twice
        return response if answered == {"api0", "api1"} else None

    response = wait_until(both_count_every_request, timeout=5, interval=0.05,
                          message=lambda: f"both processes count {server.num_requests} requests; did: {answered}")
    # where the shared engine's time went: its steps, and sending their outputs to both processes
    steps = metric(response.text, "roseray:engine_steps_total")
    step_s, output_s = (metric(response.text, f"roseray:engine_{part}_seconds_total") for part in ("step", "output"))
    assert steps >= 5 * 3 and 0.0 < step_s and 0.0 < output_s < step_s, (steps, step_s, output_s)
    # and how late the two processes read its step messages: both processes' counts summed
    delays = metric(response.text, "roseray:engine_message_delay_seconds_count")
    delay_s = metric(response.text, "roseray:engine_message_delay_seconds_sum")
    assert steps <= delays and 0.0 < delay_s < delays * 1.0, (steps, delays, delay_s)


def test_a_client_gone_mid_stream_frees_its_kv_blocks(server):
    def engine_metrics():
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return (metric(text, "roseray:num_requests_running"), metric(text, "roseray:kv_cache_usage_perc"),
                metric(text, "roseray:generation_tokens_total"))

    generated_before = engine_metrics()[2]
    body = {"prompt": "a long one", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        # the answering process's view of the engine catches up
        wait_until(lambda: engine_metrics()[0] > 0, timeout=5, interval=0.05, message="the request running")
    # the connection is closed: its API process aborts the request in the engine. Either
    # process may answer a scrape, each with its view of the engine (at most ~0.5 s old):
    # two views 0.6 s apart (the polling interval) that agree on an idle engine and its token count are current.
    views = [None]

    def idle_twice():
        views.append(engine_metrics())
        return views[-1][:2] == (0, 0) and views[-1] == views[-2]

    wait_until(idle_twice, timeout=10, interval=0.6, message=lambda: f"an idle engine; last view {views[-1]}")
    current = views[-1]
    assert current[2] < generated_before + 2000  # aborted, not finished
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert metric(text, "roseray:num_kv_blocks_free") == metric(text, "roseray:num_kv_blocks_total") == 256


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_every_process_quietly(signum):
    """SIGTERM, or Ctrl-C (SIGINT): every process drains and exits, with no traceback (uvicorn
    raises the SIGINT it held back once an API process has drained) and no leak reports."""
    server = Server()
    try:
        pids = server.pids()
        server.process.send_signal(signum)
        assert server.process.wait(30) == 0
        wait_gone(pids)
        output = server.output()
        assert output.count("Application shutdown complete.") == 2
        assert "API process 0 detached" in output and "API process 1 detached" in output
        assert not any(noise in output for noise in ("Traceback", "KeyboardInterrupt", "leaked")), output
    finally:
        server.stop()


def test_a_dead_api_process_stops_the_server_with_no_orphans():
    server = Server()
    try:
        os.kill(server.worker_pids[1], signal.SIGKILL)
        assert server.process.wait(30) == 1
        wait_gone(server.pids())
        assert "API process 1 (pid" in server.output()
    finally:
        server.stop()
