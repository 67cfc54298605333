"""Tensor-parallel engine replicas: the engine is rank 0, and N - 1 worker processes are the others.

Rank 0 runs everything of an engine (scheduler, block manager, sampler, detokenizer) once. Each
step its ModelRunner fills the staging buffer as usual, then `StepChannel.send` broadcasts the
step's plan (a few ints, host to host over gloo, so that neither side waits on its device: each
rank queues its step behind the one still running, as rank 0 alone would), the used part of the
staging buffer and, when the step fills in tokens sampled by another path, those tokens (both on
the devices); every rank then runs the same plan on its shard of the
model (roseray.layers.tensor_parallel), meeting in the layers' all-reduces and the logits'
all-gather. Workers never schedule, sample or detokenize: the host cost per step is one header
broadcast and one buffer broadcast, whatever N.

A worker builds what rank 0 builds, in the same order, because every collective must be met
by every rank: the model shard, the runner (the KV-cache profile forward; the block count
agreed as the smallest any rank allows), the warm-up forwards, the sampler's warm-up logits
and the CUDA graphs. Then it loops on StepChannel.recv until rank 0 sends STOP (at engine exit).

A worker that dies fails rank 0 (roseray.engine.rank_watchdog): between steps `check_workers`
finds it, and in the middle of one the watchdog aborts the collective rank 0 waits in.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import multiprocessing as mp
import os
import signal
import socket
import weakref

import torch

from roseray.config import EngineConfig
from roseray.distributed import abort_tensor_parallel, broadcast, init_tensor_parallel, shutdown_tensor_parallel
from roseray.engine.captured_graphs import CapturedGraphs
from roseray.engine.cpu_threads import limit_cpu_threads
from roseray.engine.model_runner import ModelRunner
from roseray.engine.parent_death import die_with
from roseray.engine.rank_watchdog import RankWatchdog, check_workers, wait_until_joining
from roseray.engine.step_inputs import PLAN_LENGTHS, STOP, StepPlan
from roseray.models.loader import load_model, load_model_config, resolve_max_model_len

logger = logging.getLogger(__name__)

HEADER = 24  # int64 slots: the plan (at most 18), then the in-flight mode and length
NO_TOKENS, OWN_DECODE_TOKENS, SENT_TOKENS = 0, 1, 2  # what a step's in-flight tokens are on the workers
JOIN_TIMEOUT_S = 30.0
WORKER_CHECK_INTERVAL_S = 1.0  # how long an idle engine loop waits at most before it checks the workers again


class StepChannel:
    """Rank 0 -> the other ranks: each step's plan, staging buffer and in-flight tokens."""

    def __init__(self, device: torch.device, max_num_seqs: int, processes: list | None = None) -> None:
        self.header = torch.zeros(HEADER, dtype=torch.int64)  # on the host: filled in place each step
        self.tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)  # a worker's receive buffer
        self.processes = processes or []  # rank 0: the workers, checked before each step

    def send(self, plan: StepPlan, buffer: torch.Tensor, in_flight: torch.Tensor | None,
             decode_tokens: torch.Tensor) -> None:
        check_workers(self.processes)  # the step fails instead of waiting on a collective a dead rank never joins
        if in_flight is None:
            mode, count = NO_TOKENS, 0
        elif in_flight.data_ptr() == decode_tokens.data_ptr():  # every rank computed the same argmax
            mode, count = OWN_DECODE_TOKENS, 0
        else:
            mode, count = SENT_TOKENS, in_flight.shape[0]
        host = self.header.numpy()
        host[:] = 0
        host[: len(plan)] = plan
        host[HEADER - 2:] = (mode, count)
        broadcast(self.header, host=True)  # returns once sent: the next step may refill it
        if plan[0] != STOP:
            broadcast(buffer[: plan[1]])
        if mode == SENT_TOKENS:
            broadcast(in_flight.to(torch.int64).contiguous())

    def recv(self, buffer: torch.Tensor, decode_tokens: torch.Tensor) -> tuple[StepPlan, torch.Tensor | None]:
        broadcast(self.header, host=True)
        values = self.header.tolist()
        plan = tuple(values[: PLAN_LENGTHS[values[0]]])
        mode, count = values[HEADER - 2:]
        if plan[0] != STOP:
            broadcast(buffer[: plan[1]])
        if mode == SENT_TOKENS:
            return plan, broadcast(self.tokens[:count])
        return plan, decode_tokens if mode == OWN_DECODE_TOKENS else None


class TensorParallelWorkers:
    """Rank 0's side: starts the workers, joins the group, sends STOP when the engine goes."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        joining = [context.Event() for _ in range(1, self.size)]  # set by each worker as it joins the group
        self.processes = [context.Process(target=worker_main, name=f"roseray-tp-rank{rank}", daemon=True,
                                          args=(rank, self.size, init_method, config, os.getpid(), joining[rank - 1]))
                          for rank in range(1, self.size)]
        for process in self.processes:
            process.start()
        try:
            wait_until_joining(self.processes, joining)
        except RuntimeError:
            for process in self.processes:
                process.terminate()
                process.join(JOIN_TIMEOUT_S)
            raise
        group = init_tensor_parallel(0, self.size, init_method)
        self.watchdog = RankWatchdog(self.processes, functools.partial(abort_tensor_parallel, group),
                                     voids_steps=group.backend == "nccl")
        self.channel: StepChannel | None = None
        self._finalizer: weakref.finalize | None = None
        logger.info("tensor parallel: %d ranks (rank 0 here, workers pids %s)", self.size,
                    [p.pid for p in self.processes])

    def attach(self, runner: ModelRunner) -> None:
        """Give rank 0's runner the channel its steps go out on; stop the workers with the runner."""
        self.channel = runner.step_channel = StepChannel(runner.device, runner.max_num_seqs, self.processes)
        self._finalizer = weakref.finalize(runner, _stop, self.channel, runner._device_buffer, runner.decode_tokens,
                                           runner.captured, self.processes, self.watchdog)

    def check(self) -> float:
        """RuntimeError naming a worker rank that exited; else how long an idle engine loop may wait
        before it checks again (a dead rank must fail the health check with no request running)."""
        self.watchdog.raise_if_failed()
        check_workers(self.processes)
        return WORKER_CHECK_INTERVAL_S

    def stop(self) -> None:
        """Stop the workers and leave the group now (also at exit, or when the runner goes); once."""
        if self._finalizer is not None:
            self._finalizer()


def _stop(channel: StepChannel, buffer: torch.Tensor, decode_tokens: torch.Tensor, captured: CapturedGraphs,
          processes: list, watchdog: RankWatchdog) -> None:
    """STOP to the workers; then every rank destroys its CUDA graphs and leaves the group at once
    (NCCL's teardown waits for both: rank 0 must not wait for its workers to exit first), then the
    joins. With a rank gone the group is aborted instead (an orderly teardown would wait for it; so
    does the watchdog's abort, if it began one, until the graphs are gone) and the ranks left, which
    wait in a collective the dead rank never joins, are terminated at once."""
    watchdog.stop()  # the workers' exit after STOP is no death (its thread ends within its poll interval)
    stopped = False
    try:
        if watchdog.failure is None and all(p.is_alive() for p in processes):
            channel.send((STOP, 0), buffer, None, decode_tokens)
            stopped = True
    except Exception as error:  # noqa: BLE001 - a worker went meanwhile (the group may be aborted under the send)
        logger.warning("tensor parallel: STOP did not reach every worker (%s); terminating them", error)
    finally:
        captured.release(wait=stopped)
        shutdown_tensor_parallel(abort=not stopped)  # after the watchdog's abort, if it began one
        for process in processes:
            if stopped:
                process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(JOIN_TIMEOUT_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(rank: int, size: int, init_method: str, config: EngineConfig, parent: int, joining) -> None:
    """A worker rank: its model shard and runner, built as rank 0 builds its own, then steps.
    `joining`: a multiprocessing Event it sets as it joins the group (rank 0 waits for it)."""
    die_with(parent)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where this rank is now
    device = config.resolve_device()
    limit_cpu_threads(device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    joining.set()
    init_tensor_parallel(rank, size, init_method)
    torch.manual_seed(config.seed)
    model_config = load_model_config(config.model, revision=config.revision, load_format=config.load_format)
    dtype = config.resolve_dtype(model_config.torch_dtype, device)
    model = load_model(model_config, config.model, device, dtype, seed=config.seed, load_format=config.load_format,
                       quantization=config.quantization)
    runner = ModelRunner(config, model_config, model, device, dtype, resolve_max_model_len(model_config, config))
    runner.warm_up()
    if device.type == "cuda":
        runner.logits_for_warm_up()  # rank 0's sampler warm-up gathers these logits
    runner.capture_cuda_graphs()
    channel = StepChannel(device, config.max_num_seqs)
    with torch.inference_mode():
        while True:
            plan, in_flight = channel.recv(runner._device_buffer, runner.decode_tokens)
            if plan[0] == STOP:
                break
            runner.run_plan(plan, in_flight)
    runner.captured.release()
    shutdown_tensor_parallel()
