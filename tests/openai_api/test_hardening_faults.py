"""Overload and faults (issue 6), over real HTTP on random:tiny:

  * a full queue answers 429 + Retry-After at once, never hangs, and every admitted request
    is served in full;
  * a KV cache too small for the load preempts (counted in roseray:num_preemptions_total,
    logged), and the preempted requests' greedy outputs equal their unpreempted outputs;
  * hundreds of clients that disconnect mid-prefill, mid-decode, while queued or before
    admission give back every block, and a later request is served at normal speed;
  * a model forward that raises ends its requests with an error (SSE error event, or a
    500), /health turns 503 after consecutive failures and 200 again once steps succeed;
    an engine step that raises outside the model ends every stream with an error event
    and /health, /ready and new requests answer 503; nothing hangs;
  * shutdown drains: in-flight requests finish within the timeout while new ones get 503,
    and those still running at the timeout end with an error event.

After every test the engine's KV accounting check passes (free + used = total, ref counts
equal the block tables, no orphan rows or requests)."""

import asyncio
import json
import logging
import re
import signal
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from roseray.config import EngineConfig, ServerConfig
from roseray.openai_api.standalone import build_server
from roseray.runtime.async_engine import AsyncLLMEngine
from tests.openai_api.helpers import MODEL, assert_openai_error, serving, wait_until_idle
from tests.waiting import wait_until

TIMEOUT = httpx.Timeout(60, connect=10)


def check_integrity(engine) -> dict:
    """The engine's accounting check, run on its loop thread; an idle engine holds no block."""
    counts = asyncio.run(engine.check_integrity())
    assert counts["num_free_blocks"] == counts["num_total_blocks"], counts
    assert counts["num_running"] == counts["num_waiting"] == 0, counts
    assert engine.num_active_requests == 0
    return counts


def data_events(text: str) -> list:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def metric(text: str, name: str, **labels: str) -> float:
    """A sample of /metrics by name and (some of) its labels."""
    for line in text.split("\n"):
        match = re.match(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", line)
        if match and all(f'{key}="{value}"' in (match.group(1) or "") for key, value in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"{name} {labels} not in /metrics")


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> SimpleNamespace:
    """POST a streamed completion; the whole SSE text, or the refusal."""
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
        text = (await response.aread()).decode()
    return SimpleNamespace(status=response.status_code, headers=response.headers, text=text)


# ---- queue limits -----------------------------------------------------------------------------------------
MAX_NUM_SEQS, MAX_WAITING = 2, 3


@pytest.fixture(scope="module")
def small_queue_server():
    config = EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=256, max_num_seqs=MAX_NUM_SEQS,
                          max_waiting_requests=MAX_WAITING)
    with serving(config, step_delay_s=0.005) as s:
        yield s


def test_past_the_queue_limit_429_with_retry_after_at_once_and_admitted_requests_finish(small_queue_server):
    url, engine = small_queue_server.url, small_queue_server.engine
    body = {"prompt": "queue", "max_tokens": 40, "ignore_eos": True, "temperature": 0}

    async def one(client, i):
        started = time.monotonic()
        result = await stream_completion(client, url, {**body, "prompt": f"queue {i}"})
        result.seconds = time.monotonic() - started
        return result

    async def burst():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(30))), 60)  # never hangs

    results = asyncio.run(burst())
    served = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    assert len(served) + len(refused) == len(results), [r.status for r in results]
    assert len(served) >= MAX_NUM_SEQS + MAX_WAITING and refused, (len(served), len(refused))
    for r in refused:
        error = json.loads(r.text)["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
        assert r.seconds < 5  # refused at once, not after waiting for room
    for r in served:  # every admitted request is served in full
        events = data_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in c for c in chunks)
    wait_until_idle(engine)
    check_integrity(engine)
    # after Retry-After, a refused client gets in
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        assert client.post("/v1/completions", json={**body, "max_tokens": 3}).status_code == 200


# ---- KV exhaustion ----------------------------------------------------------------------------------------
def test_kv_exhaustion_preempts_counts_logs_and_keeps_greedy_outputs(caplog):
    # 12 blocks of 16 tokens; each request needs up to (20 + 60) / 16 = 5 blocks: alone it fits,
    # six at once do not
    config = EngineConfig(model=MODEL, num_kv_blocks=12, block_size=16, max_model_len=128, max_num_seqs=8,
                          enable_prefix_caching=False)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(20)] for i in range(6)]
    body = {"max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with serving(config) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as client:
        def preemptions() -> float:
            return metric(client.get("/metrics").text, "roseray:num_preemptions_total")

        alone = [client.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
                 for p in prompts]
        assert preemptions() == 0  # one at a time, nothing was preempted

        async def together():
            async with httpx.AsyncClient(base_url=s.url, timeout=TIMEOUT) as c:
                responses = await asyncio.gather(*(c.post("/v1/completions", json={**body, "prompt": p})
                                                   for p in prompts))
            return [r.json() for r in responses]

        with caplog.at_level(logging.WARNING, logger="roseray.runtime.async_engine"):
            results = asyncio.run(together())
        assert preemptions() > 0, "the load did not exhaust the KV cache"
        assert any("preempted" in r.getMessage() and "KV cache full" in r.getMessage() for r in caplog.records)
        assert [r["choices"][0]["text"] for r in results] == alone  # recompute gives the same greedy tokens
        assert all(r["usage"]["completion_tokens"] == 60 for r in results)
        wait_until_idle(s.engine)
        check_integrity(s.engine)


# ---- disconnects at scale ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def disconnect_server():
    # prefill chunks of 32 tokens: a 200-token prompt spends several steps in prefill
    config = EngineConfig(model=MODEL, num_kv_blocks=256, block_size=16, max_model_len=512, max_num_seqs=32,
                          max_num_batched_tokens=64, max_waiting_requests=1024)
    with serving(config, step_delay_s=0.002) as s:
        yield s


def timed_request(url: str) -> float:
    body = {"prompt": "speed check", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
    started = time.monotonic()
    response = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 32
    return time.monotonic() - started


def test_hundreds_of_disconnects_return_every_block(disconnect_server):
    url, engine = disconnect_server.url, disconnect_server.engine
    baseline = min(timed_request(url) for _ in range(2))
    before = engine.stats
    long_prompt = [(i * 13) % 250 + 1 for i in range(200)]
    counts = {"prefill": 0, "decode": 0, "whole": 0, "instant": 0}

    async def mid_prefill(client, i):
        body = {"prompt": long_prompt[i % 7:] + [i % 250 + 1], "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
        counts["prefill"] += 1  # left with the headers: before any token (the prompt takes steps to prefill)

    async def mid_decode(client, i):
        body = {"prompt": f"decode {i}", "max_tokens": 300, "ignore_eos": True, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            seen = 0
            while seen < 2 + i % 5:  # a few tokens in
                if (await lines.__anext__()).startswith("data: "):
                    seen += 1
        counts["decode"] += 1

    async def whole_then_gone(client, i):
        body = {"prompt": f"whole {i}", "max_tokens": 300, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            await client.post(url + "/v1/completions", json=body, timeout=0.05 + (i % 4) * 0.05)
        counts["whole"] += 1

    async def instant(i):
        reader, writer = await asyncio.open_connection("127.0.0.1", disconnect_server.port)
        payload = json.dumps({"prompt": f"gone {i}", "max_tokens": 300, "ignore_eos": True,
                              "stream": i % 2 == 0}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(payload), payload))
        await writer.drain()
        writer.close()  # before any answer, possibly before admission
        await writer.wait_closed()
        counts["instant"] += 1

    async def storm():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            jobs = []
            for i in range(80):
                jobs += [mid_prefill(client, i), mid_decode(client, i)]
            jobs += [whole_then_gone(client, i) for i in range(40)]
            jobs += [instant(i) for i in range(40)]
            await asyncio.wait_for(asyncio.gather(*jobs), 120)

    asyncio.run(storm())
    assert counts == {"prefill": 80, "decode": 80, "whole": 40, "instant": 40}
    after = wait_until_idle(engine, timeout_s=10)  # every abort applied, every block free
    check_integrity(engine)
    assert after.num_free_blocks == after.num_total_blocks
    generated = after.generation_tokens_total - before.generation_tokens_total
    assert generated < 0.25 * 240 * 300, generated  # aborted early, not run to max_tokens
    later = timed_request(url)
    assert later < 2 * baseline + 0.25, (later, baseline)  # normal speed: nothing left running or leaked


# ---- model and engine faults ------------------------------------------------------------------------------
class ModelFault:
    """Makes the model's forward raise while `on`: an injected device error."""

    def __init__(self, llm) -> None:
        self.on = False
        self.calls_failed = 0
        model = llm.runner.model
        real_forward = model.forward

        def forward(*args, **kwargs):
            if self.on:
                self.calls_failed += 1
                raise RuntimeError("injected fault in the model forward")
            return real_forward(*args, **kwargs)

        model.forward = forward


def test_a_failing_model_forward_ends_its_requests_with_errors_then_recovers(caplog):
    config = EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=256, max_num_seqs=8)
    with serving(config, step_delay_s=0.005) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as client:
        fault = ModelFault(s.engine.client.engine)
        body = {"prompt": "doomed", "max_tokens": 200, "ignore_eos": True}

        async def in_flight():
            async with httpx.AsyncClient(base_url=s.url, timeout=TIMEOUT) as c:
                async def streamed():
                    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                        lines = response.aiter_lines()
                        text = ""
                        async for line in lines:
                            text += line + "\n"
                            if line.startswith("data: ") and not fault.on:
                                fault.on = True  # the stream has started: break the model now
                        return response.status_code, text

                whole = asyncio.ensure_future(c.post("/v1/completions", json=body))
                streams = await asyncio.wait_for(asyncio.gather(*(streamed() for _ in range(3))), 30)
                return streams, await asyncio.wait_for(whole, 30)

        with caplog.at_level(logging.ERROR):
            streams, whole = asyncio.run(in_flight())
        for status, text in streams:
            events = data_events(text)
            assert status == 200 and events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_error" and "engine failed" in error["message"]
        assert_openai_error(whole, 500)
        assert whole.json()["error"]["code"] == "engine_error"
        assert fault.calls_failed >= 1
        # still failing: every new request fails fast, and after 3 failed steps /health says so
        for _ in range(3):
            assert_openai_error(client.post("/v1/completions", json={**body, "max_tokens": 5}), 500)
        health = client.get("/health")
        assert health.status_code == 503 and "steps failed" in health.json()["error"]["message"]
        metrics = client.get("/metrics").text
        assert metric(metrics, "roseray:request_success_total", finished_reason="error") >= 4
        # the fault clears: the replica recovers on its own
        fault.on = False
        ok = client.post("/v1/completions", json={**body, "max_tokens": 5})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        assert client.get("/health").status_code == 200
        wait_until_idle(s.engine)
        check_integrity(s.engine)


def test_an_engine_step_that_raises_outside_the_model_fails_everything_clearly():
    config = EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=256, max_num_seqs=8)
    with serving(config, step_delay_s=0.005) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as client:
        llm, broken = s.engine.client.engine, threading.Event()
        real_schedule = llm.scheduler.schedule

        def schedule():
            if broken.is_set():
                raise AssertionError("injected scheduler bug")
            return real_schedule()

        llm.scheduler.schedule = schedule
        with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                                              "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            broken.set()
            rest = list(lines)  # ends: no hang
        events = data_events("\n".join(rest))
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and "engine loop died" in error["message"]
        for path in ("/health", "/ready"):
            assert_openai_error(client.get(path), 503)
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert_openai_error(refused, 503)
        assert refused.headers["retry-after"] == "1"


# ---- graceful drain ---------------------------------------------------------------------------------------
class DrainingServing:
    """roseray serve's server (standalone.build_server) on a free loopback port, in a thread."""

    def __init__(self, drain_timeout_s: float, step_delay_s: float) -> None:
        self.engine = AsyncLLMEngine.from_engine_config(
            EngineConfig(model=MODEL, num_kv_blocks=64, max_model_len=512, max_num_seqs=8), heartbeat_s=0.2)
        llm = self.engine.client.engine  # the LLMEngine on its thread
        real_step = llm.step

        def slow_step():
            time.sleep(step_delay_s)  # a slow engine step: streams are still running when the drain starts
            return real_step()

        llm.step = slow_step
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.server = build_server(self.engine, ServerConfig(port=self.port, drain_timeout_s=drain_timeout_s,
                                                             log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "DrainingServing":
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), timeout=30, message="uvicorn started")
        assert self.server.started, "uvicorn did not start"
        return self

    def terminate(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)  # what uvicorn's SIGTERM handler calls

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not exit"


def test_drain_lets_in_flight_finish_and_refuses_new_with_503():
    with DrainingServing(drain_timeout_s=10, step_delay_s=0.01) as s:
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as client, \
                httpx.Client(base_url=s.url, timeout=TIMEOUT) as late:
            body = {"prompt": "finish me", "max_tokens": 60, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                terminated = time.monotonic()
                s.terminate()
                wait_until(lambda: not s.engine.is_ready, timeout=5, message="the drain has begun")
                refused = late.post("/v1/completions", json={"prompt": "too late", "max_tokens": 2})
                error = assert_openai_error_any_replica(refused, 503)
                assert "draining" in error["message"] and refused.headers["retry-after"] == "1"
                assert late.get("/ready").status_code == 503 and late.get("/health").status_code == 200
                rest = list(lines)
            events = data_events("\n".join(rest))
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert "error" not in last and last["choices"][0]["finish_reason"] == "length"
            assert time.monotonic() - terminated < 10
        s.thread.join(15)
        assert not s.thread.is_alive(), "the server did not exit after the drain"
    check_integrity(s.engine)  # the loop is stopped: the check runs here, on the idle engine


def test_drain_timeout_ends_the_rest_with_an_error_event():
    with DrainingServing(drain_timeout_s=0.5, step_delay_s=0.01) as s:
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as client:
            body = {"prompt": "too long", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                terminated = time.monotonic()
                s.terminate()
                rest = list(lines)
            took = time.monotonic() - terminated
        events = data_events("\n".join(rest))
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "unavailable" and "shutting down" in error["message"]
        assert 0.4 < took < 5, took  # at the drain timeout, not at the end of the request
        s.thread.join(15)
        assert not s.thread.is_alive()
    check_integrity(s.engine)


def assert_openai_error_any_replica(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error
