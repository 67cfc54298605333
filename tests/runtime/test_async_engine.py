"""AsyncLLMEngine over the real engine on its own thread (InProcessEngineClient, random:tiny):
streams, at most one hand-off per step, abort frees blocks within one step, queue limit,
idle without spinning, liveness, a dying engine thread, drain."""

import asyncio
import threading
import time

import pytest

from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.runtime.async_engine import AsyncLLMEngine, EngineUnavailableError, LoopState, QueueFullError
from roseray.runtime.in_process_client import InProcessEngineClient
from roseray.sampling_params import SamplingParams
from tests.waiting import async_wait_until

MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def llm():
    return LLMEngine(EngineConfig(model="random:tiny", num_kv_blocks=64, max_model_len=512,
                                  max_num_seqs=MAX_NUM_SEQS))


class CountingEngine(AsyncLLMEngine):
    """Counts hand-offs from the engine thread to the event loop."""

    num_hand_offs = 0

    def _hand_off(self, *args) -> None:
        self.num_hand_offs += 1
        super()._hand_off(*args)


def run(llm, body, **kwargs):
    """Run `body(engine)` on a fresh event loop with a fresh AsyncLLMEngine over `llm`;
    the engine thread is always stopped and the engine left with no requests."""
    kwargs.setdefault("max_waiting_requests", 16)
    kwargs.setdefault("max_running", MAX_NUM_SEQS)
    engine = CountingEngine(InProcessEngineClient(llm), **kwargs)

    async def main():
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    try:
        return asyncio.run(main())
    finally:
        for request_id in list(llm.requests):
            llm.abort_request(request_id)
        while llm.has_unfinished_requests():
            LLMEngine.step(llm)  # the class method: a test may have patched the instance
        llm.check_integrity()


def params(max_tokens, **kwargs):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **kwargs)


async def collect(stream):
    deltas = []
    async for batch in stream:
        deltas.extend(batch)
    return deltas


def test_streams_every_token_with_one_hand_off_per_step(llm):
    async def body(engine):
        streams = [await engine.add_request(f"r{i}", [1 + i, 2, 3], params(8)) for i in range(3)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        return results, engine.stats.num_steps_total, engine.num_hand_offs

    results, num_steps, num_hand_offs = run(llm, body)
    for deltas in results:
        assert sum(len(d.new_token_ids) for d in deltas) == 8
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert not any(d.finished for d in deltas[:-1])
    # the engine thread hands a whole step's deltas over at once: never one call per token
    assert num_hand_offs <= num_steps
    assert num_hand_offs < sum(len(d.new_token_ids) for deltas in results for d in deltas)


def test_closing_a_stream_aborts_and_frees_its_blocks_within_one_step(llm):
    total_blocks = llm.get_stats().num_total_blocks

    async def body(engine):
        stream = await engine.add_request("long", list(range(1, 100)), params(400))
        await stream.__anext__()
        await stream.__anext__()
        assert engine.stats.num_free_blocks < total_blocks
        steps_at_close = engine.stats.num_steps_total
        stream.close()

        def freed():
            s = engine.stats
            return s if s.num_running == 0 and s.num_free_blocks == total_blocks else None

        s = await async_wait_until(freed, timeout=5, interval=0.002, message="blocks freed after close")
        return s.num_steps_total - steps_at_close

    # the step running at close() may finish; the next iteration applies the abort
    assert run(llm, body) <= 2


def test_full_queue_refuses_with_retry_after(llm):
    async def body(engine):
        streams = [await engine.add_request(f"run{i}", [1, 2, 3], params(300)) for i in range(MAX_NUM_SEQS)]
        streams.append(await engine.add_request("waits", [1, 2, 3], params(300)))
        # the adds the engine has not shown in its stats yet count against the queue at once
        with pytest.raises(QueueFullError) as refused:
            await engine.add_request("refused", [1, 2, 3], params(4))
        await async_wait_until(lambda: engine.stats.num_waiting == 1, message="one request waiting")
        with pytest.raises(QueueFullError):  # and once they are there
            await engine.add_request("refused-again", [1, 2, 3], params(4))
        for stream in streams:
            stream.close()
        return refused.value

    error = run(llm, body, max_waiting_requests=1, retry_after_s=3)
    assert error.retry_after_s == 3
    assert "queue is full" in str(error)


def test_invalid_request_is_rejected_and_the_engine_keeps_serving(llm):
    async def body(engine):
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("too-long", [1, 2, 3], params(10_000))
        return await collect(await engine.add_request("fine", [1, 2, 3], params(3)))

    deltas = run(llm, body)
    assert deltas[-1].num_output_tokens == 3


def test_idle_loop_sleeps_and_keeps_its_heartbeat(llm):
    async def body(engine):
        await collect(await engine.add_request("one", [1, 2, 3], params(2)))
        await async_wait_until(lambda: engine.stats.num_running == 0 and engine.stats.num_waiting == 0,
                               message="the engine idle")
        steps, cpu = engine.stats.num_steps_total, time.process_time()
        await asyncio.sleep(0.6)  # time passes on an idle engine: no steps, no CPU, the heartbeat goes on
        return engine.stats.num_steps_total - steps, time.process_time() - cpu, engine.stats.last_heartbeat

    new_steps, cpu_seconds, last_heartbeat = run(llm, body, heartbeat_s=0.1)
    assert new_steps == 0
    assert cpu_seconds < 0.15  # waiting on an event, not polling
    assert time.monotonic() - last_heartbeat < 0.5


def test_check_health_fails_while_a_step_is_stuck(llm, monkeypatch):
    hang, release = threading.Event(), threading.Event()
    real_step = llm.step

    def stuck_step():
        if hang.is_set():
            release.wait(10)
        return real_step()

    monkeypatch.setattr(llm, "step", stuck_step)

    async def body(engine):
        stream = await engine.add_request("stuck", [1, 2, 3], params(20))
        hang.set()
        engine.check_health()

        def reported_stuck():
            try:
                engine.check_health()
            except RuntimeError as error:
                return "stuck" in str(error)
            return False

        await async_wait_until(reported_stuck, timeout=5, message="check_health reports the stuck step")
        with pytest.raises(RuntimeError, match="stuck"):
            engine.check_health()
        assert not engine.is_ready
        release.set()
        await collect(stream)
        engine.check_health()
        return engine.is_ready

    assert run(llm, body, stuck_after_s=0.3)


def test_a_dying_loop_fails_its_streams_and_health(llm, monkeypatch):
    real_step, calls = llm.step, []

    def broken_step():  # the first step works, the second raises out of the engine
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(llm, "step", broken_step)

    async def body(engine):
        stream = await engine.add_request("doomed", [1, 2, 3], params(5))
        with pytest.raises(EngineUnavailableError, match="boom"):
            await collect(stream)
        assert engine.state is LoopState.DEAD
        with pytest.raises(RuntimeError, match="died"):
            engine.check_health()
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("after", [1, 2, 3], params(5))

    run(llm, body)


def test_drain_refuses_new_requests_and_lets_running_ones_finish(llm):
    async def body(engine):
        stream = await engine.add_request("running", [1, 2, 3], params(20))
        drained = asyncio.ensure_future(engine.drain(timeout_s=10))
        await async_wait_until(lambda: engine.state is LoopState.DRAINING, timeout=5, message="draining")
        assert not engine.is_ready
        with pytest.raises(EngineUnavailableError, match="draining"):
            await engine.add_request("late", [1, 2, 3], params(2))
        deltas = await collect(stream)
        await drained
        return deltas

    deltas = run(llm, body)
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 20


def test_check_health_fails_after_consecutive_failed_model_steps(llm, monkeypatch):
    real_step, broken = llm.step, threading.Event()

    def step():  # what LLMEngine.step does when the forward raises: keep going, record the error
        if not broken.is_set():
            return real_step()
        llm.last_error = RuntimeError("device error")
        for request_id in list(llm.requests):
            llm.abort_request(request_id)
        return LLMEngine.step(llm)

    monkeypatch.setattr(llm, "step", step)
    monkeypatch.setattr(llm, "last_error", None)

    async def body(engine):
        await collect(await engine.add_request("ok", [1, 2, 3], params(2)))
        engine.check_health()
        broken.set()
        for i in range(3):
            await collect(await engine.add_request(f"fails{i}", [1, 2, 3], params(2)))
        with pytest.raises(RuntimeError, match="steps failed"):
            engine.check_health()
        broken.clear()
        await collect(await engine.add_request("recovered", [1, 2, 3], params(2)))
        engine.check_health()

    run(llm, body, max_failed_steps=3)


def test_after_shutdown_the_engine_on_its_thread_is_left_consistent_and_still_checkable(llm):
    """Stopping aborts what is left (its blocks are freed); the engine outlives its thread, so
    the integrity check still runs, on the caller's thread."""
    async def body(engine):
        stream = await engine.add_request("cut", [1, 2, 3], params(300))
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            await collect(stream)
        return await engine.check_integrity()

    counts = run(llm, body)
    assert counts["num_free_blocks"] == counts["num_total_blocks"] and counts["num_running"] == 0
