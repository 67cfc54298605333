"""A tensor-parallel engine (TP=2 on CPU, gloo) behind AsyncLLMEngine whose worker rank is
killed, on both transports (the engine on a thread of this process, and in an engine process):
idle, the health check fails within a few seconds naming the rank (no request has to find
it); streaming, the running request and the one queued behind it end with an error (the
failed step's reason "error", or the loop's death naming the rank), not a hang."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.runtime.async_engine import AsyncLLMEngine, EngineUnavailableError, LoopState
from roseray.runtime.in_process_client import InProcessEngineClient
from roseray.sampling_params import SamplingParams
from tests.waiting import async_wait_until

RANK_DEAD = "tensor-parallel rank 1 exited"
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)  # runs well past the kill


def config(**overrides) -> EngineConfig:
    # max_num_seqs 1: a second request waits in the queue behind the first
    return EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=64, max_model_len=512, max_num_seqs=1,
                        tensor_parallel_size=2, **overrides)


def spawned_children(pid: int) -> list[int]:
    """The tensor-parallel worker processes (multiprocessing's spawn) of process `pid`."""
    return [child.pid for child in psutil.Process(pid).children()
            if "spawn_main" in " ".join(child.cmdline())]


class TensorParallelEngine:
    """An AsyncLLMEngine over a TP=2 engine on `transport` ("thread" or "process"), and its worker's pid."""

    def __init__(self, transport: str) -> None:
        self.llm = None
        if transport == "thread":
            self.llm = LLMEngine(config())
            self.engine = AsyncLLMEngine(InProcessEngineClient(self.llm), max_waiting_requests=8, max_running=1)
            [self.worker] = [p.pid for p in self.llm.tp_workers.processes]
        else:
            self.engine = AsyncLLMEngine.from_engine_config(config(engine_process=True))
            [self.worker] = spawned_children(self.engine.client.pid)

    def kill_worker(self) -> None:
        os.kill(self.worker, signal.SIGKILL)

    def close(self) -> None:
        self.engine.stop()
        self.engine.wait_stopped(15)
        if self.llm is not None:
            self.llm.tp_workers.stop()  # leaves the group (aborted: its worker is gone)


def health_error(engine: AsyncLLMEngine) -> str | None:
    try:
        engine.check_health()
    except RuntimeError as error:
        return str(error)
    return None


async def end_of(stream) -> str:
    """How the stream ended: its error, or its last delta's finish reason."""
    last = None
    try:
        async for deltas in stream:
            last = deltas[-1]
    except EngineUnavailableError as error:
        return str(error)
    return f"finished: {last.finish_reason}"


@pytest.fixture(params=["thread", "process"])
def tp_engine(request):
    tp = TensorParallelEngine(request.param)
    yield tp
    tp.close()


def test_an_idle_engine_whose_worker_dies_fails_its_health_check_naming_the_rank(tp_engine):
    async def main():
        engine = tp_engine.engine
        engine.start()
        stream = await engine.add_request("before", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
        async for _ in stream:  # the two ranks step together
            pass
        assert health_error(engine) is None
        tp_engine.kill_worker()
        error = await async_wait_until(lambda: health_error(engine), timeout=10,
                                       message="an idle engine with a dead rank still passes its health check")
        assert "engine loop died" in error and RANK_DEAD in error, error
        assert engine.state is LoopState.DEAD
        with pytest.raises(EngineUnavailableError):
            await engine.add_request("after", [1], SamplingParams())

    asyncio.run(main())


def test_streams_running_and_queued_when_the_worker_dies_end_with_an_error_naming_the_rank(tp_engine):
    async def main():
        engine = tp_engine.engine
        engine.start()
        running = await engine.add_request("running", [1, 2, 3], LONG)
        queued = await engine.add_request("queued", [4, 5, 6], LONG)
        await running.__anext__()  # it streams
        tp_engine.kill_worker()

        ends = await asyncio.wait_for(asyncio.gather(end_of(running), end_of(queued)), timeout=30)
        # the step the rank died in ends its request with reason "error" (the API's engine error event),
        # unless the loop's end (naming the rank) came first; the loop's end fails whatever is left
        for end in ends:
            assert end == "finished: error" or ("engine loop died" in end and RANK_DEAD in end), ends
        error = await async_wait_until(lambda: health_error(engine), timeout=10)
        assert RANK_DEAD in error, error

    asyncio.run(main())
