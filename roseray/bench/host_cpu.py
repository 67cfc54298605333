"""CPU time of every process on this machine over a block of a benchmark, by role.

A W-seed burst through the Ray Serve app keeps a dozen processes busy at once (the load
generator, HAProxy, the Routers, the API processes, the engine child), on a host whose
vCPUs the engine shares with them. `host_cpu_use()` reads every thread's time on a CPU
(/proc/PID/task/TID/schedstat, nanoseconds; kept by every kernel, unlike the waiting time
beside it) before and after the block and adds it up by role, so a burst says where the
host's CPU went: the engine's, the HTTP path's, or the load generator's.

Roles come from each process's command line (`role_of`); `pids` names the ones the
caller knows (the server's engine child, the in-process engine's). A thread that ends within
the block is not counted (its /proc entry is gone): the processes measured here keep theirs.
Linux only: elsewhere the dict stays empty.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

# (substring of the command line, role), first match wins; checked after the caller's pids
# and after the Serve replicas (role_of)
_ROLES = (
    (b"roseray.engine.engine_process", "engine child (other)"),
    (b"replica_api_worker", "API processes"),
    (b"roseray.server.api_worker", "API processes"),
    (b"ray::", "Ray Serve and Ray"),  # the controller, the proxy, Ray's own workers
    (b"raylet", "Ray Serve and Ray"),
    (b"gcs_server", "Ray Serve and Ray"),
    (b"ray/dashboard", "Ray Serve and Ray"),
    (b"ray-dashboard", "Ray Serve and Ray"),  # the dashboard's modules, forked by its forkserver
    (b"ray.dashboard", "Ray Serve and Ray"),
    (b"ray/_private", "Ray Serve and Ray"),
    (b"multiprocessing", "load generator"),  # the client processes (spawned) and their resource tracker
)


def role_of(cmdline: bytes, comm: bytes = b"") -> str:
    """The role of a process from its command line (NUL-separated, as /proc gives it) and its
    name (/proc/PID/comm)."""
    if comm.strip() == b"haproxy" or b"haproxy" in cmdline.split(b"\0", 1)[0]:
        return "HAProxy"
    if b"ray::ServeReplica:" in cmdline:
        return "Routers" if b"Router" in cmdline else "Engine replica actor"
    return next((role for needle, role in _ROLES if needle in cmdline), "other")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def process_cpu_s(pid: int) -> float:
    """Seconds on a CPU of all of process `pid`'s threads so far (0.0 once it is gone)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            total += int(_read(f"/proc/{pid}/task/{tid}/schedstat").split(maxsplit=1)[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


class HostCPU:
    """Snapshots of every process's CPU seconds, summed by role between two of them.
    Roles are looked up once per pid; `pids` maps known pids to their role."""

    def __init__(self, pids: dict[int, str] | None = None) -> None:
        self.pids = dict(pids or {})
        self.pids.setdefault(os.getpid(), "benchmark process")
        self._roles: dict[int, str] = {}

    def _role(self, pid: int) -> str:
        role = self._roles.get(pid)
        if role is None:
            role = self.pids.get(pid)
            if role is None:
                try:
                    role = role_of(_read(f"/proc/{pid}/cmdline"), _read(f"/proc/{pid}/comm"))
                except OSError:
                    role = "other"
            self._roles[pid] = role
        return role

    def snapshot(self) -> dict[int, float]:
        """{pid: CPU seconds so far} of every process now running; {} without /proc."""
        try:
            names = os.listdir("/proc")
        except OSError:
            return {}
        return {int(name): process_cpu_s(int(name)) for name in names if name.isdigit()}

    def by_role(self, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
        """CPU seconds per role between two snapshots (a process that started in between
        counts from zero; one that ended in between is not counted), largest first."""
        roles: dict[str, float] = {}
        for pid, seconds in after.items():
            used = seconds - before.get(pid, 0.0)
            if used > 0:
                role = self._role(pid)
                roles[role] = roles.get(role, 0.0) + used
        return dict(sorted(roles.items(), key=lambda item: -item[1]))


@contextlib.contextmanager
def host_cpu_use(host: HostCPU | None):
    """Fills the yielded dict, on exit, with `host_cpu_ms` ({role: ms on a CPU over the
    block}) and `host_cpu_snapshot_ms` (what one snapshot took: outside the block, but the
    caller's process pays it). Nothing when `host` is None or there is no /proc."""
    found: dict = {}
    if host is None:
        yield found
        return
    started = time.perf_counter()
    before = host.snapshot()
    snapshot_s = time.perf_counter() - started
    yield found
    after = host.snapshot()
    if before and after:
        found["host_cpu_ms"] = {role: s * 1e3 for role, s in host.by_role(before, after).items()}
        found["host_cpu_snapshot_ms"] = snapshot_s * 1e3


def median_host_cpu(runs: list[dict]) -> dict[str, float]:
    """Each role's median CPU ms over the bursts that recorded host_cpu_ms (a role absent
    from a burst used none in it), with the total's median as "all"; largest first."""
    recorded = [r["host_cpu_ms"] for r in runs if "host_cpu_ms" in r]
    if not recorded:
        return {}
    roles = {role for burst in recorded for role in burst}
    medians = {role: statistics.median([burst.get(role, 0.0) for burst in recorded]) for role in roles}
    medians = dict(sorted(medians.items(), key=lambda item: -item[1]))
    medians["all"] = statistics.median([sum(burst.values()) for burst in recorded])
    return medians
