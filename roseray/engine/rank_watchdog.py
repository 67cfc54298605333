"""Rank 0's watch over its tensor-parallel worker ranks, for a rank that dies in the middle of a step.

Between steps the engine asks `check_workers` (the idle loop every second, and before each step's
broadcast). But a rank that dies while rank 0 waits in a collective (a layer's all-reduce, the
logits' all-gather, the step's broadcast) leaves rank 0 inside that collective: over NCCL for
ever, for its kernels spin until the communicator is aborted. So a daemon thread waits on the
workers' process sentinels; when one exits it records why (`failure`, naming the rank and its
exit code) and aborts the group (roseray.distributed.abort_tensor_parallel), which ends the
collective rank 0 waits in and every later one. The step in progress then ends, its outputs
void: LLMEngine.step raises `failure`, and the engine's loop ends on it as on any dead rank
(its streams end with the error, the health check fails).

The thread stops before rank 0 sends STOP (the workers' orderly exit is no death).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5  # how often the thread looks up from the sentinels to see whether it should stop
EXIT_WAIT_S = 5.0  # for the exit code of a process whose sentinel is ready


def check_workers(processes: list) -> None:
    """RuntimeError naming the first worker rank (of `processes`, ranks 1..N-1) that exited. Cheap:
    a waitpid per worker."""
    for rank, process in enumerate(processes, start=1):
        if not process.is_alive():
            raise RuntimeError(f"tensor-parallel rank {rank} exited (exit code {process.exitcode}); "
                               "the engine replica must be restarted")


class RankWatchdog:
    """Watches `processes` (multiprocessing Processes, ranks 1..N-1) from a daemon thread; on the
    first exit sets `failure` and calls `abort` (the group's abort) once."""

    def __init__(self, processes: list, abort: Callable[[], None]) -> None:
        self.processes = processes
        self.failure: RuntimeError | None = None
        self._abort = abort
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="roseray-tp-watchdog", daemon=True)
        self._thread.start()

    def raise_if_failed(self) -> None:
        """`failure` if a rank died: whatever rank 0 computed since is void."""
        if self.failure is not None:
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
            for process in self.processes:
                if process.sentinel in ready:  # ready as the process exits, a moment before it can be reaped
                    process.join(EXIT_WAIT_S)
            try:
                check_workers(self.processes)
                self.failure = RuntimeError("a tensor-parallel rank exited; the engine replica must be restarted")
            except RuntimeError as error:
                self.failure = error
            logger.error("%s: aborting the tensor-parallel group, so that a step waiting on it fails", self.failure)
            try:
                self._abort()
            except Exception:  # noqa: BLE001 - the failure is recorded; the engine fails on it regardless
                logger.exception("aborting the tensor-parallel group failed")
            return
