"""roseray.bench.cpu_placement: reading and fixing which vCPU a process runs on."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from roseray.bench.common import engine_cpu_use
from roseray.bench.cpu_placement import keep_off, last_cpu, pin_process, restore

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux and two CPUs")

# two threads that keep running: a pin has to cover every thread of the process
_SPIN = "import threading, time\nthreading.Thread(target=lambda: time.sleep(60), daemon=True).start()\n" \
        "while True: pass\n"


@pytest.fixture
def spinner():
    child = subprocess.Popen([sys.executable, "-c", _SPIN])
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{child.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield child
    finally:
        child.kill()
        child.wait()


def _allowed(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def test_pin_process_puts_every_thread_on_the_cpu_and_it_runs_there(spinner):
    cpus = os.sched_getaffinity(0)
    cpu = max(cpus)
    changed = pin_process(spinner.pid, {cpu})
    assert len(changed) >= 2
    assert all(allowed == {cpu} for allowed in _allowed(spinner.pid))
    deadline = time.monotonic() + 5
    while last_cpu(spinner.pid) != cpu and time.monotonic() < deadline:
        time.sleep(0.01)
    assert last_cpu(spinner.pid) == cpu
    with engine_cpu_use(spinner.pid) as found:
        time.sleep(0.2)
    assert found["engine_process_last_cpu"] == cpu
    if "engine_process_migrations" in found:  # where the kernel keeps /proc/PID/sched
        assert found["engine_process_migrations"] == 0
    restore(changed)
    assert all(allowed == cpus for allowed in _allowed(spinner.pid))


def test_keep_off_moves_other_threads_and_spares_the_named(spinner):
    cpus = os.sched_getaffinity(0)
    cpu = max(cpus)
    other = subprocess.Popen([sys.executable, "-c", _SPIN])
    try:
        time.sleep(0.2)
        # `among`: this test must not move the rest of the machine's threads
        moved = keep_off({cpu}, spare={spinner.pid}, among=[spinner.pid, other.pid])
        assert len(moved) >= 2  # the other spinner's threads
        assert all(allowed == cpus - {cpu} for allowed in _allowed(other.pid))
        assert all(allowed == cpus for allowed in _allowed(spinner.pid))  # spared
        restore(moved)
        assert all(allowed == cpus for allowed in _allowed(other.pid))
    finally:
        other.kill()
        other.wait()


def test_last_cpu_of_a_gone_process_is_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert last_cpu(child.pid) is None
    assert pin_process(child.pid, {0}) == []
