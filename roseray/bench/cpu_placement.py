"""Where a benchmark's processes run: which vCPU an engine child was on, and pinning it.

On the GPU host (a KVM guest of 16 vCPUs) the same pure-Python loop takes up to twice as
long on one vCPU as on another, and which vCPUs are slow changes from minute to minute
(BENCHMARKS.md, twelfth session). When a benchmark compares two engines, each in its own
process, the scheduler's placement of each is then part of the comparison. These helpers
read the placement (`last_cpu`) and fix it: `pin_process` puts every thread of a process on
the given CPUs, `keep_off` moves every other thread of the machine off them (root, or the
threads' owner, may do it; kernel threads bound to a CPU are left alone). Threads and
processes started later inherit their creator's affinity; `restore` undoes both. Linux only.
"""

from __future__ import annotations

import os


def _tids(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def last_cpu(pid: int) -> int | None:
    """The CPU that process `pid`'s main thread last ran on (/proc/PID/stat, field 39), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after its last ')'
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[36]) if len(fields) > 36 else None


Changed = list[tuple[int, set[int]]]  # (thread id, its affinity before): what `restore` puts back


def pin_process(pid: int, cpus: set[int]) -> Changed:
    """Every thread of `pid` may run only on `cpus`. Returns what it changed."""
    changed = []
    for tid in _tids(pid):
        try:
            before = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
            changed.append((tid, before))
        except OSError:  # the thread ended meanwhile
            continue
    return changed


def keep_off(cpus: set[int], spare: set[int], among: list[int] | None = None) -> Changed:
    """Every thread of every process (or of those in `among`) but those in `spare` stops
    running on `cpus` (where it may run elsewhere). Returns what it changed."""
    changed = []
    pids = among if among is not None else [int(name) for name in os.listdir("/proc") if name.isdigit()]
    for pid in pids:
        if pid in spare:
            continue
        for tid in _tids(pid):
            try:
                allowed = os.sched_getaffinity(tid)
                if allowed & cpus and allowed - cpus:
                    os.sched_setaffinity(tid, allowed - cpus)
                    changed.append((tid, allowed))
            except OSError:  # gone, a kernel thread bound to its CPU, or not ours to move
                continue
    return changed


def restore(changed: Changed) -> None:
    """Put back the affinities that `pin_process` or `keep_off` changed (threads still alive)."""
    for tid, before in changed:
        try:
            os.sched_setaffinity(tid, before)
        except OSError:
            continue
