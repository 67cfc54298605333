"""Rank 0's watch over its tensor-parallel worker ranks, for a rank that dies in the middle of a step.

Between steps the engine asks `check_workers` (the idle loop every second, and before each step's
broadcast). But a rank that dies while rank 0 waits in a collective (a layer's all-reduce, the
logits' all-gather, the step's broadcast) leaves rank 0 inside that collective: over NCCL for
ever, for its kernels spin until the communicator is aborted. So a daemon thread waits on the
workers' process sentinels; when one exits it records why (`failure`, naming the rank and its
exit code) and aborts the group (roseray.distributed.abort_tensor_parallel), which ends the
collective rank 0 waits in and every later one. The step in progress then ends: over gloo it
raised (its requests end with an error), over NCCL its aborted collectives returned garbage, so
LLMEngine.step raises `failure` instead of returning it. Either way the engine's loop ends on the
failure as on any dead rank (its streams end with an error, the health check fails).

The thread stops before rank 0 sends STOP (the workers' orderly exit is no death).

Before any of that, rank 0 waits for its workers to reach the group's rendezvous
(`wait_until_joining`): a worker that dies on its way there (an import, a device that fails)
fails the engine's start at once, naming its rank, instead of leaving rank 0 in a rendezvous
that waits for it for the store's whole timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5  # how often the thread looks up from the sentinels to see whether it should stop
STARTUP_TIMEOUT_S = 600.0  # for the workers to reach the rendezvous (spawned interpreters importing torch)
EXIT_WAIT_S = 5.0  # for the exit code of a process whose sentinel is ready


def rank_exited(rank: int, exit_code: int | None) -> str:
    return f"tensor-parallel rank {rank} exited (exit code {exit_code}); the engine replica must be restarted"


def check_workers(processes: list) -> None:
    """RuntimeError naming the first worker rank (of `processes`, ranks 1..N-1) that exited. Cheap:
    a waitpid per worker."""
    for rank, process in enumerate(processes, start=1):
        if not process.is_alive():
            raise RuntimeError(rank_exited(rank, process.exitcode))


def wait_until_joining(processes: list, joining: list, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Return once every worker (`processes`, ranks 1..N-1) has set its `joining` event (it is about to
    join the group); RuntimeError naming the first that exited before, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not all(event.is_set() for event in joining):
        for rank, (process, event) in enumerate(zip(processes, joining), start=1):
            if not event.is_set() and not process.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (exit code {_exit_code(process)}) before "
                                   "joining the group; see its log above")
        if time.monotonic() > deadline:
            missing = [rank for rank, event in enumerate(joining, start=1) if not event.is_set()]
            raise RuntimeError(f"tensor-parallel ranks {missing} did not start within {timeout_s:.0f} s")
        wait([process.sentinel for process in processes], timeout=0.05)


class RankWatchdog:
    """Watches `processes` (multiprocessing Processes, ranks 1..N-1) from a daemon thread; on the
    first exit sets `failure`, then calls `abort` (the group's abort) once. `voids_steps`: that abort
    ends the collectives in flight without an error (NCCL's kernels just quit), so a step in progress
    computed garbage; over gloo a collective cut short by a dead rank raises in the step itself."""

    def __init__(self, processes: list, abort: Callable[[], None], voids_steps: bool) -> None:
        self.processes = processes
        self.voids_steps = voids_steps
        self.failure: RuntimeError | None = None
        self._abort = abort
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="roseray-tp-watchdog", daemon=True)
        self._thread.start()

    def raise_if_failed(self) -> None:
        """`failure` if a rank died."""
        if self.failure is not None:
            raise self.failure

    def raise_if_void(self) -> None:
        """`failure` if a rank died and the abort voids what rank 0's steps computed (see voids_steps)."""
        if self.voids_steps and self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        """No more watching (rank 0 is about to stop its workers); the thread ends within POLL_INTERVAL_S,
        or once an abort it began returns."""
        self._stopped.set()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def _watch(self) -> None:
        sentinels = [process.sentinel for process in self.processes]
        while not self._stopped.is_set():
            ready = wait(sentinels, timeout=POLL_INTERVAL_S)
            if not ready or self._stopped.is_set():
                continue
            rank, process = next((rank, p) for rank, p in enumerate(self.processes, start=1) if p.sentinel in ready)
            self.failure = RuntimeError(rank_exited(rank, _exit_code(process)))
            logger.error("%s: aborting the tensor-parallel group, so that a step waiting on it fails", self.failure)
            try:
                self._abort()
            except Exception:  # noqa: BLE001 - the failure is recorded; the engine fails on it regardless
                logger.exception("aborting the tensor-parallel group failed")
            return


def _exit_code(process) -> int | None:
    """The exit code of a process whose sentinel is ready: that happens as it exits, a moment before it
    can be reaped, and another thread (a check_workers) may be reaping it meanwhile."""
    process.join(EXIT_WAIT_S)
    deadline = time.monotonic() + EXIT_WAIT_S
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return process.exitcode
