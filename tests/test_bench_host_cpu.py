"""Every process's CPU use over a benchmark's block, by role (roseray/bench/host_cpu.py)."""

import os
import subprocess
import sys
import time

import pytest

from roseray.bench.host_cpu import HostCPU, host_cpu_use, process_cpu_s, role_of

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.mark.parametrize("cmdline, comm, role", [
    (b"/usr/sbin/haproxy\0-f\0/tmp/ray/haproxy.cfg", b"haproxy\n", "HAProxy"),
    (b"/py/bin/python\0-m\0roseray.engine.engine_process\0--commands-fd\x003", b"python", "engine child (other)"),
    (b"/py/bin/python\0-m\0roseray.serve.replica_api_worker\0--index\x001", b"python", "API processes"),
    (b"/py/bin/python\0-m\0roseray.server.api_worker\0--index\x000", b"python", "API processes"),
    (b"ray::ServeReplica:default:Router", b"ray::ServeRepli", "Routers"),
    (b"ray::ServeReplica:default:Engine", b"ray::ServeRepli", "Engine replica actor"),
    (b"ray::ServeController", b"ray::ServeContr", "Ray Serve and Ray"),
    (b"/py/lib/ray/core/src/ray/raylet/raylet\0--node", b"raylet", "Ray Serve and Ray"),
    (b"ray-dashboard-NodeHead-0 (/py/bin/python -B -c \"from multiprocessing.forkserver import main", b"ray-dashboard-N",
     "Ray Serve and Ray"),
    (b"/py/bin/python\0-B\0-c\0from multiprocessing.forkserver import main; main(25, 27, ['ray', 'ray.dashboard.x'])",
     b"python", "Ray Serve and Ray"),
    (b"/py/bin/python\0-c\0from multiprocessing.spawn import spawn_main; spawn_main()", b"python", "load generator"),
    (b"/usr/bin/sshd", b"sshd", "other"),
])
def test_role_of_names_each_process_of_a_ray_serve_run(cmdline, comm, role):
    assert role_of(cmdline, comm) == role


@linux_only
def test_host_cpu_counts_a_busy_child_under_its_role_and_this_process_by_pid():
    spin = "print(flush=True)\nwhile True: pass"  # until killed
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # spinning
        host = HostCPU({child.pid: "spinner"})
        started = time.monotonic()
        with host_cpu_use(host) as found:
            time.sleep(0.3)
            deadline = time.process_time() + 0.05
            while time.process_time() < deadline:
                pass
        block_ms = (time.monotonic() - started) * 1e3  # the snapshots included: at least 350 ms
    finally:
        child.kill()
        child.wait()
    roles = found["host_cpu_ms"]
    # at most one CPU for as long as the block lasted; at least half of the 0.3 s sleep on a busy box
    assert 150 <= roles["spinner"] <= block_ms + 20
    assert roles["benchmark process"] >= 40  # this process, by its pid
    assert list(roles.values()) == sorted(roles.values(), reverse=True)
    assert found["host_cpu_snapshot_ms"] > 0


@linux_only
def test_process_cpu_s_adds_every_live_thread_and_a_gone_process_is_zero():
    import threading

    done = threading.Event()

    def spin():
        deadline = time.thread_time() + 0.1
        while time.thread_time() < deadline:
            pass
        done.wait()  # alive while read: a thread that has ended is no longer listed

    before = process_cpu_s(os.getpid())
    threads = [threading.Thread(target=spin) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and process_cpu_s(os.getpid()) - before < 0.18:
        time.sleep(0.01)
    used = process_cpu_s(os.getpid()) - before
    done.set()
    for thread in threads:
        thread.join()
    assert used >= 0.18  # both threads' time, not the main thread's alone
    assert process_cpu_s(2**22 + 12345) == 0.0


def test_host_cpu_use_without_a_host_fills_nothing():
    with host_cpu_use(None) as found:
        pass
    assert found == {}


def test_by_role_skips_ended_processes_and_counts_new_ones_from_zero():
    host = HostCPU({1: "a", 2: "b", 3: "a"})
    roles = host.by_role({1: 1.0, 2: 5.0, 4: 9.0}, {1: 1.5, 2: 5.0, 3: 0.25})
    assert roles == {"a": 0.75}  # pid 2 idle, pid 4 gone, pid 3 new
