"""The engine in its own process (EngineProcessClient behind AsyncLLMEngine), on CPU with
random:tiny: the same outputs as the engine on a thread of this process, admission errors,
aborts and disconnects freeing blocks in the child, a killed child failing its streams
(503, health), a failed start raising the child's error, and the HTTP app on top of it."""

import asyncio
import json
import os
import signal
import threading

import httpx
import pytest

from roseray import envs
from roseray.config import EngineConfig
from roseray.engine.outputs import RequestSummary
from roseray.runtime.async_engine import AsyncLLMEngine, EngineUnavailableError, LoopState
from roseray.runtime.engine_client import EngineError
from roseray.runtime.messages import AbortRequest, AddRequests, decode
from roseray.runtime.process_client import EngineProcessClient
from roseray.sampling_params import SamplingParams, StructuredOutputs
from tests.openai_api.helpers import serving, sse_events, wait_until_idle
from tests.runtime.client_helpers import check_integrity, run_to_end, wait_outputs
from tests.waiting import async_wait_until

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
# constrained requests join the batch once their grammar compiled (on a thread): when differs from run to run,
# so they are not in the equality test above (a batch's composition moves fp32 logits by rounding)
CONSTRAINED = [
    ("as json", SamplingParams(temperature=0.8, seed=3, max_tokens=300,
                               structured_outputs=StructuredOutputs.json_schema(
                                   {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 99}},
                                    "required": ["n"], "additionalProperties": False}))),
    ([8, 9], SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=StructuredOutputs.choice(["ab", "cd"]))),
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


CHILD_ENGINE = {"max_logprobs": 4}  # the shared engine process's config: config(engine_process=True, **CHILD_ENGINE)


@pytest.fixture(scope="module")
def child_engine():
    """One engine process for the tests that neither stop, stall nor kill it."""
    engine = AsyncLLMEngine.from_engine_config(config(engine_process=True, **CHILD_ENGINE), heartbeat_s=0.2)
    yield engine
    engine.stop()
    engine.wait_stopped(15)


def test_outputs_equal_the_in_process_engine(child_engine):
    async def in_thread():
        engine = AsyncLLMEngine.from_engine_config(config(**CHILD_ENGINE))
        engine.start()
        try:
            return await generate_all(engine)
        finally:
            await engine.shutdown()

    async def in_child():
        child_engine.start()
        return await generate_all(child_engine)

    expected, outputs = asyncio.run(in_thread()), asyncio.run(in_child())
    assert outputs == expected
    assert outputs[1][2] and all(isinstance(k, int) for k in outputs[1][2][0])  # logprobs keyed by token id
    assert outputs[3][3] == "stop" and outputs[3][4] == "iii"  # the stop string, reported as stop_reason


def test_constrained_requests_in_the_child(child_engine):
    async def main():
        child_engine.start()

        async def one(i, prompt, params):
            stream = await child_engine.add_request(f"s{i}", prompt, params)
            text, last = "", None
            async for deltas in stream:
                text += "".join(d.new_text for d in deltas)
                last = deltas[-1]
            return text, last.finish_reason

        return await asyncio.gather(*[one(i, p, s) for i, (p, s) in enumerate(CONSTRAINED)])

    (json_text, json_finish), (choice, choice_finish) = asyncio.run(main())
    assert json_finish == "stop" and 0 <= json.loads(json_text)["n"] <= 99
    assert choice_finish == "stop" and choice in ("ab", "cd")


def test_admission_errors_are_the_engine_messages(child_engine):
    async def main():
        child_engine.start()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await child_engine.add_request("bad-id", [10**6], SamplingParams())
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await child_engine.add_request("too-long", [1] * 1000, SamplingParams(max_tokens=100))
        with pytest.raises(ValueError, match="logprobs must be at most 4"):
            await child_engine.add_request("lp", [1], SamplingParams(logprobs=5))
        with pytest.raises(ValueError, match=r"structured output \(regex\)"):
            await child_engine.add_request("re", [1],
                                           SamplingParams(structured_outputs=StructuredOutputs("regex", "(")))
        assert (await child_engine.check_integrity())["num_running"] == 0

    asyncio.run(main())


def test_closing_constrained_streams_frees_blocks_and_matchers(child_engine):
    """Constrained streams closed mid-way (and one closed while its grammar may still compile):
    the child's KV blocks and constrained-request count are back to empty, and a new constrained
    request still runs to a valid end."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 50}

    async def main():
        child_engine.start()
        streams = [await child_engine.add_request(f"c{i}", [1, 2, 3], SamplingParams(
            max_tokens=1000, temperature=1.0, structured_outputs=StructuredOutputs.json_schema(schema)))
            for i in range(4)]
        streams[0].close()  # at once
        for stream in streams[1:]:
            async for _ in stream:
                break
            stream.close()
        await async_wait_until(lambda: not child_engine.client.has_unfinished_requests(),
                               message="the aborts reached the engine process")
        counts = await child_engine.check_integrity()  # includes the constrained-request count
        assert counts["num_free_blocks"] == counts["num_total_blocks"] and counts["num_running"] == 0
        stream = await child_engine.add_request("after", [4], SamplingParams(
            max_tokens=300, structured_outputs=StructuredOutputs.json_schema(schema, any_whitespace=False)))
        text, last = "", None
        async for deltas in stream:
            text += "".join(d.new_text for d in deltas)
            last = deltas[-1]
        assert last.finish_reason == "stop" and isinstance(json.loads(text), list)

    asyncio.run(main())


def test_closing_a_stream_aborts_in_the_child_and_frees_its_blocks(child_engine):
    async def main():
        child_engine.start()
        generated_before = child_engine.stats.generation_tokens_total
        stream = await child_engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))
        received = 0
        async for deltas in stream:
            received += sum(len(d.new_token_ids) for d in deltas)
            if received >= 5:
                break
        stream.close()
        await async_wait_until(lambda: not child_engine.client.has_unfinished_requests(),
                               message="the abort reached the engine process")
        counts = await child_engine.check_integrity()
        assert counts["num_free_blocks"] == counts["num_total_blocks"] and counts["num_running"] == 0
        assert child_engine.stats.generation_tokens_total - generated_before < 1000  # aborted, not run to the end

    asyncio.run(main())


def test_a_killed_engine_process_fails_streams_and_health():
    async def main():
        engine = AsyncLLMEngine.from_engine_config(config(engine_process=True), heartbeat_s=0.2)
        engine.start()
        stream = await engine.add_request("victim", [1, 2], SamplingParams(max_tokens=1000, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine.client.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailableError, match="engine loop died"):
            async for _ in stream:
                pass
        assert engine.state is LoopState.DEAD and isinstance(engine.dead_error, EngineError)
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
    process = engine.client._process
    engine.stop()
    engine.wait_stopped(15)
    assert process.wait(10) == 0


def test_finished_deltas_carry_the_request_summary(child_engine):
    async def main():
        child_engine.start()
        stream = await child_engine.add_request("summary", [3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
        last = [d async for deltas in stream for d in deltas][-1]
        assert last.finished and isinstance(last.request, RequestSummary)
        summary = last.request
        assert summary.first_scheduled_time is None or summary.first_scheduled_time >= summary.arrival_time
        assert last.num_output_tokens == 4 and last.request.num_cached_tokens == 0

    asyncio.run(main())


def test_http_app_over_the_engine_process():
    with serving(config(engine_process=True)) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        assert server.engine.client.pid != os.getpid()
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
            # long enough to be still running when the process stops right after its first delta, short enough
            # to finish soon once it runs again
            stream = await engine.add_request("slow", [1, 2], SamplingParams(max_tokens=200, ignore_eos=True))
            await stream.__anext__()
            os.kill(engine.client.pid, signal.SIGSTOP)  # a hung device or a wedged process: no steps, no exit
            await async_wait_until(lambda: not engine.is_alive, interval=0.05,
                                   message="a stalled engine process no longer counts as alive")
            with pytest.raises(RuntimeError, match="stuck"):
                engine.check_health()
            os.kill(engine.client.pid, signal.SIGCONT)
            async for deltas in stream:  # it finishes once the process runs again  # noqa: B007
                pass
            assert deltas[-1].finished and deltas[-1].finish_reason == "length"
            engine.check_health()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def spy_on_commands(client: EngineProcessClient) -> list:
    """The commands `client` sends from now on, as raw bytes."""
    sent, send_bytes = [], client._commands.send_bytes
    client._commands.send_bytes = lambda data: (sent.append(data), send_bytes(data))[1]
    return sent


def test_a_burst_of_adds_goes_as_one_message_and_runs_as_one_batch():
    """128 requests submitted at once (W-seed) must not cost 128 pipe messages and child
    wake-ups, nor trickle into the child's steps: the adds held until flush_commands go as
    one AddRequests (an abort sent after them still follows them), and the child schedules
    them all in its first step."""
    client = EngineProcessClient(config(async_scheduling=False))
    try:
        sent = spy_on_commands(client)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        for i in range(6):
            client.add_request(f"b{i}", [1 + i, 2], params)
        client.abort_request("b5")
        messages = [decode(data) for data in sent]
        assert [type(m) for m in messages] == [AddRequests, AbortRequest] and len(messages[0].handles) == 6
        assert messages[0].params[0] == params
        # on the wire ([kind, handles, token_ids, params, arrival_times]) only the non-defaults
        assert json.loads(sent[0])[3][0] == {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}
        deltas = []
        while not deltas:
            deltas = wait_outputs(client)
        first = [d for d in deltas if d.new_token_ids][:5]
        assert sorted(d.request_id for d in first) == [f"b{i}" for i in range(5)]
        deltas += run_to_end(client)
        finished = {d.request_id: d.finish_reason for d in deltas if d.finished}
        assert finished == {**{f"b{i}": "length" for i in range(5)}, "b5": "abort"}
        check_integrity(client)
    finally:
        client.close()


def test_started_on_an_event_loop_the_engine_process_is_driven_by_it():
    """No thread: the event loop reads the step messages (add_reader) and sends the adds of
    one loop iteration as one message at its end. Started off a loop, the engine is driven by
    the loop of its first request."""
    async def main():
        engine = AsyncLLMEngine.from_engine_config(config(engine_process=True), heartbeat_s=0.1)
        engine.start()
        sent = spy_on_commands(engine.client)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        streams = [await engine.add_request(f"r{i}", [1 + i, 2], params) for i in range(5)]
        assert sent == []  # held until the end of this loop iteration
        outputs = [[t async for deltas in stream for d in deltas for t in d.new_token_ids] for stream in streams]
        messages = [decode(data) for data in sent]
        assert [(type(m), len(m.handles)) for m in messages] == [(AddRequests, 5)]
        assert all(len(tokens) == 4 for tokens in outputs)
        assert threading.active_count() == threads_before
        counts = await engine.check_integrity()  # on the loop, between two reads
        assert counts["num_free_blocks"] == counts["num_total_blocks"]
        await asyncio.sleep(0.3)  # time passes on an idle engine (3 heartbeats): the tick keeps it alive
        assert engine.is_alive
        process = engine.client._process
        await engine.shutdown()
        assert process.poll() == 0 and engine.state is LoopState.STOPPED

    threads_before = threading.active_count()
    asyncio.run(main())
    off_loop = AsyncLLMEngine.from_engine_config(config(engine_process=True))
    off_loop.start()  # no running loop: the first request's loop drives it

    async def one_request():
        stream = await off_loop.add_request("late", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
        return [d async for deltas in stream for d in deltas][-1]

    try:
        last = asyncio.run(one_request())
        assert last.finished and last.num_output_tokens == 3
    finally:
        off_loop.stop()
        off_loop.wait_stopped(15)


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
        sent = spy_on_commands(engine.client)
        long = await engine.add_request("long", [1, 2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        tokens = long.__aiter__()
        await tokens.__anext__()  # it runs: the stats say so
        assert engine.stats.num_running == 1 and [type(decode(m)) for m in sent] == [AddRequests]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        streams = [await engine.add_request(f"r{i}", [3 + i, 2], params) for i in range(3)]
        assert [len(decode(m).handles) for m in sent[1:]] == ([] if hold else [1, 1, 1])
        for stream in streams:
            assert len([t async for deltas in stream for d in deltas for t in d.new_token_ids]) == 2
        assert [len(decode(m).handles) for m in sent[1:]] == ([3] if hold else [1, 1, 1])
        long.close()
        await engine.shutdown()

    asyncio.run(main())
