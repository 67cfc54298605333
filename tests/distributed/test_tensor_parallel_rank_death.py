"""A tensor-parallel worker rank that dies while rank 0 is inside a step, blocked in a collective
the dead rank never joins (TP=2 behind AsyncLLMEngine, the engine on a thread or in an engine
process): the stream ends with an error within a bound (not a hang), the health check fails naming
the rank and its exit code, and nothing of the engine is left running. The worker is stopped
(SIGSTOP) first, so that rank 0 is certainly waiting on it when the SIGKILL comes: its step makes
no progress, and on CPU (gloo, engine thread) it waits inside roseray.distributed.

CPU: gloo. GPU (two CUDA devices, NCCL, CUDA graphs capturing the all-reduces): the same test,
marked gpu, with the all-reduces through NCCL and through roseray's abortable symmetric-memory kernel
(ROSERAY_TP_ALL_REDUCE=triton); run it on a 2-GPU host."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from dataclasses import replace

import psutil
import pytest
import torch

from roseray import distributed, envs
from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.runtime.async_engine import AsyncLLMEngine, LoopState
from roseray.runtime.in_process_client import InProcessEngineClient
from roseray.sampling_params import SamplingParams
from roseray.triton_all_reduce import TritonAllReduce
from tests.distributed.test_tensor_parallel_health import end_of, spawned_children
from tests.waiting import async_wait_until, wait_until

RANK_KILLED = "tensor-parallel rank 1 exited (exit code -9)"
LONG = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)  # runs well past the kill
END_BOUND_S = 30.0  # the stream's end after the kill (gloo and the watchdog take well under a second)
STUCK_S = 1.0  # rank 0's step has made no progress this long: it waits on the stopped worker

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def in_collective(thread: threading.Thread) -> bool:
    """`thread` is inside one of roseray.distributed's collectives now."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_filename == distributed.__file__:
            return True
        frame = frame.f_back
    return False


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class TensorParallelEngine:
    """An AsyncLLMEngine over a TP=2 engine on `transport` ("thread" or "process"), its worker's pid,
    and what tells whether rank 0's step makes progress."""

    def __init__(self, transport: str, config: EngineConfig) -> None:
        self.llm = self.engine_thread = None
        if transport == "thread":
            self.llm = LLMEngine(config)
            self.client = InProcessEngineClient(self.llm)
            self.engine = AsyncLLMEngine(self.client, max_waiting_requests=8, max_running=1)
            [self.worker] = [p.pid for p in self.llm.tp_workers.processes]
            self.engine_thread = self.client._thread
        else:
            self.engine = AsyncLLMEngine.from_engine_config(replace(config, engine_process=True))
            self.client = self.engine.client
            [self.worker] = spawned_children(self.client.pid)

    def close(self) -> None:
        self.engine.stop()
        self.engine.wait_stopped(15)
        if self.llm is not None:
            self.llm.tp_workers.stop()  # leaves the group (aborted: its worker is gone)


def run_kill_mid_step(transport: str, device: str, **overrides) -> None:
    config = EngineConfig(model="random:tiny", device=device, num_kv_blocks=64, max_model_len=512, max_num_seqs=1,
                          tensor_parallel_size=2, **overrides)
    tp = TensorParallelEngine(transport, config)
    engine, client = tp.engine, tp.client
    if tp.llm is not None:  # the group's collectives wait as long as the engine idles (not NCCL's 10 min)
        backend = distributed.tensor_parallel().group._get_backend(torch.device(device))
        assert backend.options._timeout == distributed.COLLECTIVE_TIMEOUT
        if envs.tp_all_reduce() == "triton":  # not NCCL after all (that is logged, not raised)
            assert isinstance(distributed._SYMMETRIC, TritonAllReduce), distributed._SYMMETRIC
    try:
        async def main():
            engine.start()
            stream = await engine.add_request("long", [1, 2, 3], LONG)
            await stream.__anext__()  # the two ranks step together
            os.kill(tp.worker, signal.SIGSTOP)
            await async_wait_until(lambda: time.monotonic() - client.heartbeat() > STUCK_S, timeout=10,
                                   message="rank 0 went on stepping without its stopped worker")
            if tp.engine_thread is not None and device == "cpu":
                assert in_collective(tp.engine_thread), "rank 0 waits for its stopped worker outside a collective"
            killed = time.monotonic()
            os.kill(tp.worker, signal.SIGKILL)
            end = await asyncio.wait_for(end_of(stream), timeout=END_BOUND_S)
            seconds = time.monotonic() - killed
            # the failed step ends its request with reason "error" (the API's engine error event), unless
            # the loop's end naming the rank came first (as the watchdog's failure does when it is first)
            assert end == "finished: error" or ("engine loop died" in end and RANK_KILLED in end), end
            error = await async_wait_until(lambda: health_error(engine), timeout=10)
            assert RANK_KILLED in error, error
            assert engine.state is LoopState.DEAD
            print(f"{transport}: stream ended {seconds:.2f} s after the kill: {end}")

        asyncio.run(main())
    finally:
        tp.close()
    wait_until(lambda: gone(tp.worker), timeout=10, message="the killed worker is still there")
    if tp.engine_thread is not None:
        assert not tp.engine_thread.is_alive()
        wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("roseray-tp")], timeout=5,
                   message="a tensor-parallel thread of rank 0 outlived the engine")
    else:
        wait_until(lambda: gone(client.pid), timeout=15, message="the engine process outlived its dead rank")


def health_error(engine: AsyncLLMEngine) -> str | None:
    try:
        engine.check_health()
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["thread", "process"])
def test_a_worker_killed_while_rank_0_waits_in_a_collective_ends_the_stream_and_fails_the_engine(transport):
    run_kill_mid_step(transport, "cpu")


@pytest.mark.gpu
@two_gpus
@pytest.mark.timeout(300)  # without the watchdog's abort rank 0 spins in a collective: the test fails, not the run
@pytest.mark.parametrize("all_reduce", ["nccl", "triton"])
@pytest.mark.parametrize("transport", ["thread", "process"])
def test_on_two_gpus_a_worker_killed_mid_step_ends_the_stream_and_fails_the_engine(transport, all_reduce,
                                                                                   monkeypatch):
    monkeypatch.setenv(envs.TP_ALL_REDUCE_ENV, all_reduce)  # read by every rank as it joins the group
    run_kill_mid_step(transport, "cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=64)
