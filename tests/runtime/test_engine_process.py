"""The engine loop in its own process (EngineProcessClient behind AsyncLLMEngine), on CPU
with random:tiny: the same outputs as the in-process engine, admission errors, aborts
and disconnects freeing blocks in the child, a killed child failing its streams (503,
health), a failed start raising the child's error, and the HTTP app on top of it."""

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from roseray import envs
from roseray.config import EngineConfig
from roseray.engine.engine import EngineStats
from roseray.engine.request import RequestDelta, RequestSummary
from roseray.runtime.async_engine import AsyncLLMEngine, EngineUnavailableError, LoopState
from roseray.runtime.engine_process import EngineProcessClient, EngineProcessError, _apply, _loads, encode_step
from roseray.sampling_params import SamplingParams
from tests.openai_api.test_server_api import serving, sse_events, wait_until_idle

MODEL = "random:tiny"


def config(**overrides) -> EngineConfig:
    values = dict(model=MODEL, device="cpu", num_kv_blocks=128, max_model_len=1024, max_num_seqs=8)
    return EngineConfig(**{**values, **overrides})


REQUESTS = [
    ([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
    ("hello there", SamplingParams(temperature=0.0, max_tokens=17, logprobs=3, ignore_eos=True)),
    ([9] * 40, SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)),
    ([5, 6], SamplingParams(temperature=0.0, max_tokens=30, stop=["iii"], ignore_eos=True)),
    ([7, 7, 7], SamplingParams(temperature=0.0, max_tokens=12, presence_penalty=0.5, ignore_eos=True)),
]


async def generate_all(engine: AsyncLLMEngine) -> list[tuple]:
    async def one(i, prompt, params):
        stream = await engine.add_request(f"r{i}", prompt, params)
        tokens, text, logprobs, last = [], "", [], None
        async for deltas in stream:
            for delta in deltas:
                tokens += delta.new_token_ids
                text += delta.new_text
                logprobs += delta.new_logprobs or []
                last = delta
        return tokens, text, logprobs, last.finish_reason, last.request.stop_reason, last.num_output_tokens

    results = await asyncio.gather(*[one(i, p, s) for i, (p, s) in enumerate(REQUESTS)])
    counts = await engine.check_integrity()
    assert counts["num_free_blocks"] == counts["num_total_blocks"]
    return results


def run_engine(engine_process: bool):
    async def main():
        engine = AsyncLLMEngine.from_engine_config(config(engine_process=engine_process))
        engine.start()
        try:
            return await generate_all(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_outputs_equal_the_in_process_engine():
    in_thread, in_child = run_engine(False), run_engine(True)
    assert in_child == in_thread
    assert in_child[1][2] and all(isinstance(k, int) for k in in_child[1][2][0])  # logprobs keyed by token id
    assert in_child[3][3] == "stop" and in_child[3][4] == "iii"  # the stop string, reported as stop_reason


@pytest.fixture(scope="module")
def child_engine():
    engine = AsyncLLMEngine.from_engine_config(config(engine_process=True, max_logprobs=4), heartbeat_s=0.2)
    yield engine
    engine.stop()
    engine._thread.join(15)


def test_admission_errors_are_the_engine_messages(child_engine):
    async def main():
        child_engine.start()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await child_engine.add_request("bad-id", [10**6], SamplingParams())
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await child_engine.add_request("too-long", [1] * 1000, SamplingParams(max_tokens=100))
        with pytest.raises(ValueError, match="logprobs must be at most 4"):
            await child_engine.add_request("lp", [1], SamplingParams(logprobs=5))
        assert (await child_engine.check_integrity())["num_running"] == 0

    asyncio.run(main())


def test_closing_a_stream_aborts_in_the_child_and_frees_its_blocks(child_engine):
    async def main():
        child_engine.start()
        stream = await child_engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
        received = 0
        async for deltas in stream:
            received += sum(len(d.new_token_ids) for d in deltas)
            if received >= 5:
                break
        stream.close()
        deadline = time.monotonic() + 10
        while child_engine.engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the abort did not reach the engine process"
            await asyncio.sleep(0.01)
        counts = await child_engine.check_integrity()
        assert counts["num_free_blocks"] == counts["num_total_blocks"] and counts["num_running"] == 0
        assert child_engine.stats.generation_tokens_total < 1000

    asyncio.run(main())


def test_a_killed_engine_process_fails_streams_and_health():
    async def main():
        engine = AsyncLLMEngine.from_engine_config(config(engine_process=True), heartbeat_s=0.2)
        engine.start()
        stream = await engine.add_request("victim", [1, 2], SamplingParams(max_tokens=1000, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine.engine.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailableError, match="engine loop died"):
            async for _ in stream:
                pass
        assert engine.state is LoopState.DEAD and isinstance(engine.dead_error, EngineProcessError)
        with pytest.raises(RuntimeError, match="engine loop died"):
            engine.check_health()
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("after", [1], SamplingParams())

    asyncio.run(main())


def test_a_failed_start_raises_the_engine_processes_error():
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        AsyncLLMEngine.from_engine_config(config(engine_process=True, max_model_len=10**6))


def test_stop_ends_the_engine_process():
    engine = AsyncLLMEngine.from_engine_config(config(engine_process=True))
    engine.start()
    process = engine.engine._process
    engine.stop()
    engine._thread.join(15)
    assert process.wait(10) == 0


def test_finished_deltas_carry_the_request_summary(child_engine):
    async def main():
        child_engine.start()
        stream = await child_engine.add_request("summary", [3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
        last = [d async for deltas in stream for d in deltas][-1]
        assert last.finished and isinstance(last.request, RequestSummary)
        scheduled, arrival = last.request.first_scheduled_time, last.request.arrival_time
        assert scheduled is None or scheduled >= arrival
        assert last.num_output_tokens == 4 and last.request.num_cached_tokens == 0

    asyncio.run(main())


def test_http_app_over_the_engine_process():
    with serving(config(engine_process=True)) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert server.engine.engine.pid != os.getpid()
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events = sse_events(client.post("/v1/completions", json=body).text)
        assert events[-1]["usage"]["completion_tokens"] == 8
        whole = client.post("/v1/completions", json={**body, "stream": False}).json()
        assert whole["choices"][0]["text"] == "".join(e["choices"][0]["text"] for e in events if e["choices"])
        bad = client.post("/v1/completions", json={**body, "max_tokens": 5000})
        assert bad.status_code == 400 and "max_model_len" in bad.json()["error"]["message"]
        # a client that goes away mid-stream: the child aborts it and frees its blocks
        with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 900}) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
        idle = wait_until_idle(server.engine, timeout_s=10)
        assert idle.num_free_blocks == idle.num_total_blocks


def test_a_stalled_engine_process_fails_health_and_recovers_when_it_resumes():
    async def main():
        engine = AsyncLLMEngine.from_engine_config(config(engine_process=True), heartbeat_s=0.1, stuck_after_s=1.0)
        engine.start()
        try:
            stream = await engine.add_request("slow", [1, 2], SamplingParams(max_tokens=1000, ignore_eos=True))
            await stream.__anext__()
            os.kill(engine.engine.pid, signal.SIGSTOP)  # a hung device or a wedged process: no steps, no exit
            deadline = time.monotonic() + 10
            while engine.is_alive:
                assert time.monotonic() < deadline, "a stalled engine process still counts as alive"
                await asyncio.sleep(0.05)
            with pytest.raises(RuntimeError, match="stuck"):
                engine.check_health()
            os.kill(engine.engine.pid, signal.SIGCONT)
            async for deltas in stream:  # noqa: B007 - it finishes once the process runs again
                pass
            assert deltas[-1].finished and deltas[-1].finish_reason == "length"
            engine.check_health()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_request_the_engine_process_cannot_take_finishes_with_an_error():
    """The client validated it, yet the engine's add_request raised: the child reports it as
    one finished delta with reason "error" instead of dying (engine_process._apply)."""
    class RefusingEngine:
        def add_request(self, *args, **kwargs):
            raise RuntimeError("out of something")

        def get_stats(self):
            return EngineStats(0, 0, 8, 8, 0.0, 0, 0, 0, 0, 0)

    sent = []
    stop = _apply(RefusingEngine(), ["add", [["7", [1, 2], {"max_tokens": 4}, 0.0]]], sent.append)
    assert not stop and len(sent) == 1
    kind, handles, token_ids, texts, num_outputs, extras, stats, error, sent_at = _loads(sent[0])
    assert (kind, handles, token_ids, texts, num_outputs, error) == ("step", ["7"], [[]], [""], [0], None)
    assert 0 <= time.monotonic() - sent_at < 5  # the child's time.monotonic(), one clock per host
    assert extras == [[0, True, "error", None, [None, 0, None]]] and stats[3] == 8
    assert _loads(encode_step([], stats, None))[0] == "step"


def test_a_burst_of_adds_goes_as_one_message_and_runs_as_one_batch():
    """128 requests submitted at once (W-seed) must not cost 128 pipe messages and child
    wake-ups, nor trickle into the child's steps: the adds of one loop iteration go as one
    "add" message (an abort sent after them still follows them), and the child schedules
    them all in its first step."""
    client = EngineProcessClient(config(async_scheduling=False))
    try:
        sent = []
        send_bytes = client._commands.send_bytes
        client._commands.send_bytes = lambda data: (sent.append(_loads(data)), send_bytes(data))[1]
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        for i in range(6):
            client.add_request(f"b{i}", [1 + i, 2], params)
        client.abort_request("b5")
        assert [m[0] for m in sent] == ["add", "abort"] and len(sent[0][1]) == 6
        assert sent[0][1][0][2] == {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}  # non-defaults only
        deltas = []
        while not deltas:
            deltas = client.step()
        first = [d for d in deltas if d.new_token_ids][:5]
        assert sorted(d.request_id for d in first) == [f"b{i}" for i in range(5)]
        while client.has_unfinished_requests():
            deltas += client.step()
        finished = {d.request_id: d.finish_reason for d in deltas if d.finished}
        assert finished == {**{f"b{i}": "length" for i in range(5)}, "b5": "abort"}
        client.check_integrity()
    finally:
        client.close()


def test_started_on_an_event_loop_the_engine_process_is_driven_by_it():
    """No loop thread: the event loop reads the step messages (add_reader) and sends the
    adds of one loop iteration as one message at its end; thread mode started off a loop."""
    async def main():
        engine = AsyncLLMEngine.from_engine_config(config(engine_process=True), heartbeat_s=0.1)
        engine.start()
        assert engine._on_loop and engine._thread is None
        sent = []
        send_bytes = engine.engine._commands.send_bytes
        engine.engine._commands.send_bytes = lambda data: (sent.append(_loads(data)), send_bytes(data))[1]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        streams = [await engine.add_request(f"r{i}", [1 + i, 2], params) for i in range(5)]
        assert sent == []  # held until the end of this loop iteration
        outputs = [[t async for deltas in stream for d in deltas for t in d.new_token_ids] for stream in streams]
        assert [(m[0], len(m[1])) for m in sent] == [("add", 5)] and all(len(tokens) == 4 for tokens in outputs)
        assert threading.active_count() == threads_before
        counts = await engine.check_integrity()  # on the loop, between two reads
        assert counts["num_free_blocks"] == counts["num_total_blocks"]
        await asyncio.sleep(0.3)  # idle: the tick keeps the heartbeat fresh
        assert engine.is_alive
        process = engine.engine._process
        await engine.shutdown()
        assert process.poll() == 0 and engine.state is LoopState.STOPPED

    threads_before = threading.active_count()
    asyncio.run(main())
    off_loop = AsyncLLMEngine.from_engine_config(config(engine_process=True))
    off_loop.start()  # no running loop: the loop thread drives it
    assert not off_loop._on_loop and off_loop._thread.is_alive()
    off_loop.stop()
    off_loop._thread.join(15)


@pytest.mark.parametrize("hold", [False, True])
def test_while_the_engine_steps_an_add_goes_at_once(monkeypatch, hold):
    """The engine process takes commands between steps: once it steps, an add held to the end
    of a busy loop iteration could miss steps, so each goes at once (an idle engine still gets
    one iteration's adds as one message: the test above). ROSERAY_ADD_FLUSH=iteration, the
    experiment switch, holds them as before."""
    if hold:
        monkeypatch.setenv(envs.ADD_FLUSH_ENV, "iteration")

    async def main():
        engine = AsyncLLMEngine.from_engine_config(config(engine_process=True), heartbeat_s=0.1)
        engine.start()
        sent = []
        send_bytes = engine.engine._commands.send_bytes
        engine.engine._commands.send_bytes = lambda data: (sent.append(_loads(data)), send_bytes(data))[1]
        long = await engine.add_request("long", [1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        tokens = long.__aiter__()
        await tokens.__anext__()  # it runs: the stats say so
        assert engine.stats.num_running == 1 and [m[0] for m in sent] == ["add"]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        streams = [await engine.add_request(f"r{i}", [3 + i, 2], params) for i in range(3)]
        assert [(m[0], len(m[1])) for m in sent[1:]] == ([] if hold else [("add", 1)] * 3)
        for stream in streams:
            assert len([t async for deltas in stream for d in deltas for t in d.new_token_ids]) == 2
        assert [(m[0], len(m[1])) for m in sent[1:]] == ([("add", 3)] if hold else [("add", 1)] * 3)
        long.close()
        await engine.shutdown()

    asyncio.run(main())


def test_a_step_message_sends_a_single_token_bare_and_a_list_otherwise():
    deltas = [RequestDelta("1", [5], "a", False, None, None, 1, 1, None),
              RequestDelta("2", [], "", True, "abort", None, 1, 0, RequestSummary(0.0)),
              RequestDelta("3", [6, 7], "bc", False, None, None, 1, 2, None)]
    assert _loads(encode_step(deltas, [], None))[2] == [5, [], [6, 7]]


def test_wake_ends_a_wait_for_the_next_step_message():
    """The loop thread waits inside step() for the engine process's next step message; an
    add or abort queued meanwhile wakes it (EngineProcessClient.wake, from another thread),
    so the command reaches the child before its next step instead of after it. Repeated
    wakes while one is pending cost nothing; wake after close is a no-op."""
    import threading

    client = EngineProcessClient(config(), poll_s=30.0)  # idle child: no step message would come
    try:
        returned = []
        waiter = threading.Thread(target=lambda: returned.append(client.step()))
        started = time.monotonic()
        waiter.start()
        time.sleep(0.2)
        client.wake()
        waiter.join(5)
        assert not waiter.is_alive() and returned == [[]] and time.monotonic() - started < 5
        assert not client._wake_pending  # the next wait can be woken again
        client.wake()
        client.wake()  # one is pending: no second byte
        assert os.read(client._wake_r, 16) == b"\0"
        os.write(client._wake_w, b"\0")  # put it back: the next wait returns at once
        assert client.step() == [] and not client._wake_pending
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        client.add_request("w", [1, 2], params)
        deltas = []
        while client.has_unfinished_requests():
            deltas += client.step()
        assert [d.request_id for d in deltas if d.finished] == ["w"]
    finally:
        client.close()
    client.wake()  # closed: nothing is written anywhere


def test_the_async_engine_wakes_an_engine_waiting_for_a_step_on_every_command():
    class WakeableEngine:
        def __init__(self):
            self.wakes = 0

        def wake(self):
            self.wakes += 1

    engine = WakeableEngine()
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=4)
    async_engine._signal()
    assert engine.wakes == 1 and async_engine._wake.is_set()
