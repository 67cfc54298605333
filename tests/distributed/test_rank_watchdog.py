"""RankWatchdog on its own, over real processes standing in for worker ranks: a killed rank trips
it (failure names the rank and its exit code, the abort runs once, promptly); ranks that stay
alive, or a watchdog stopped before its ranks exit (the orderly STOP), abort nothing. A group
that abort_tensor_parallel (the watchdog's call) aborted fails every later collective at once;
a group's collectives wait as long as an engine idles."""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time

import pytest
import torch

from roseray import distributed
from roseray.engine.rank_watchdog import POLL_INTERVAL_S, RankWatchdog, wait_until_joining
from roseray.engine.tensor_parallel_workers import _free_port
from tests.waiting import wait_until


def sleepers(count: int) -> list:
    # fork: a child that only sleeps starts in milliseconds (spawn would import the test session's modules)
    processes = [mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True) for _ in range(count)]
    for process in processes:
        process.start()
    return processes


@pytest.fixture
def ranks():
    processes = sleepers(3)  # ranks 1, 2, 3
    yield processes
    for process in processes:
        process.kill()
        process.join(10)


class Aborts:
    def __init__(self) -> None:
        self.calls: list[float] = []
        self.thread_names: list[str] = []

    def __call__(self) -> None:
        self.calls.append(time.monotonic())
        self.thread_names.append(threading.current_thread().name)


def test_a_killed_rank_trips_the_watchdog_once_naming_the_rank_and_its_exit_code(ranks):
    aborts = Aborts()
    watchdog = RankWatchdog(ranks, aborts, voids_steps=False)
    watchdog.raise_if_failed()  # all alive: nothing to raise
    killed = time.monotonic()
    ranks[1].kill()  # rank 2
    wait_until(lambda: aborts.calls, timeout=5, message="the watchdog did not abort the group")
    assert aborts.calls[0] - killed < 2.0  # the sentinel wakes it, no polling period needed
    assert aborts.thread_names == ["roseray-tp-watchdog"]  # from its own thread: rank 0's may be blocked
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 2 exited \(exit code -9\)"):
        watchdog.raise_if_failed()
    watchdog.raise_if_void()  # gloo's abort leaves no garbage: a step cut short raised by itself
    watchdog.join(5)
    ranks[0].kill()  # a second death after the first changes nothing
    ranks[0].join(5)
    assert len(aborts.calls) == 1 and "rank 2" in str(watchdog.failure)


def test_live_ranks_and_a_stop_before_the_orderly_exit_abort_nothing(ranks):
    aborts = Aborts()
    watchdog = RankWatchdog(ranks, aborts, voids_steps=True)
    time.sleep(3 * POLL_INTERVAL_S)  # nothing to wait for: it must do nothing over several of its poll periods
    assert watchdog._thread.is_alive() and not aborts.calls and watchdog.failure is None
    watchdog.stop()  # as rank 0 does before it sends STOP
    for process in ranks:
        process.terminate()  # the workers' exit after STOP
        process.join(5)
    watchdog.join(5)
    assert not watchdog._thread.is_alive()
    assert not aborts.calls and watchdog.failure is None
    watchdog.raise_if_failed()
    watchdog.raise_if_void()
    assert all(p.exitcode == -signal.SIGTERM for p in ranks)


def test_over_nccl_a_dead_rank_voids_the_step_in_progress(ranks):
    """NCCL's abort ends the collectives in flight without an error: the step must not return what it
    computed. The failure is set before the abort, which is what lets a blocked step return."""
    seen = []
    watchdog = RankWatchdog(ranks, lambda: seen.append(watchdog.failure), voids_steps=True)
    ranks[2].kill()  # rank 3, while another thread reaps it too (the engine's check_workers)
    ranks[2].join(5)
    wait_until(lambda: seen, timeout=5)
    assert "rank 3 exited (exit code -9)" in str(seen[0])
    with pytest.raises(RuntimeError, match="rank 3 exited"):
        watchdog.raise_if_void()


def join_and_wait(init_method: str) -> None:
    """Rank 1 of 2: two all-reduces with rank 0, then it waits to be killed."""
    distributed.init_tensor_parallel(1, 2, init_method, backend="gloo")
    for _ in range(2):
        distributed.all_reduce(torch.ones(2))
    time.sleep(60)


def test_an_aborted_group_fails_every_later_collective_at_once_and_a_group_waits_as_long_as_idle():
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    worker = mp.get_context("spawn").Process(target=join_and_wait, args=(init_method,), daemon=True)
    worker.start()
    try:
        group = distributed.init_tensor_parallel(0, 2, init_method, backend="gloo")
        # an idle engine's workers wait in the step broadcast for as long as it is idle, not 30 minutes
        gloo = distributed.tensor_parallel().group._get_backend(torch.device("cpu"))
        assert gloo.options._timeout == distributed.COLLECTIVE_TIMEOUT
        assert distributed.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
        distributed.abort_tensor_parallel(distributed.TensorParallel(0, 2))  # another group's: not this one's
        assert distributed.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
        distributed.abort_tensor_parallel(group)  # the watchdog's call (gloo's group itself is left alone)
        for collective in (lambda: distributed.all_reduce(torch.ones(2)), lambda: distributed.broadcast(torch.ones(2)),
                           lambda: distributed.all_gather_last(torch.ones(2))):
            with pytest.raises(RuntimeError, match="group was aborted"):
                collective()  # at once: rank 1 is alive and would never join it
    finally:
        worker.kill()
        worker.join(10)
        distributed.shutdown_tensor_parallel(abort=True)
    assert distributed.tensor_parallel().size == 1
    distributed.init_tensor_parallel(0, 1, "unused")
    assert not distributed._aborted  # a new group starts whole
    distributed.shutdown_tensor_parallel()


def test_a_rank_that_dies_before_joining_fails_the_start_at_once(ranks):
    """Rank 0 waits for its workers to reach the rendezvous; one that exits on the way fails the start
    at once, naming it (a rendezvous would wait for it for the store's whole timeout)."""
    joining = [mp.get_context("fork").Event() for _ in ranks]
    joining[0].set()
    ranks[1].kill()  # rank 2, before it joined
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 2 exited \(exit code -9\) before joining"):
        wait_until_joining(ranks, joining, timeout_s=30)
    assert time.monotonic() - started < 5


def test_joining_returns_once_every_rank_joins_and_times_out_otherwise(ranks):
    joining = [mp.get_context("fork").Event() for _ in ranks]
    threading.Timer(0.3, lambda: [event.set() for event in joining]).start()
    wait_until_joining(ranks, joining, timeout_s=30)
    late = [mp.get_context("fork").Event() for _ in ranks]
    late[0].set()
    with pytest.raises(RuntimeError, match=r"ranks \[2, 3\] did not start within 1 s"):
        wait_until_joining(ranks, late, timeout_s=1)
