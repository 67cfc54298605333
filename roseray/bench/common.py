"""Shared pieces of the benchmarks: percentiles, result files, tables."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch


def percentiles(values, qs=(50, 95, 99)) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def cpu_and_wait_s(pid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of process `pid` so far,
    from /proc/PID/schedstat (its main thread); None where the kernel does not keep it.
    Waiting time that grows during a run means the process was short of CPU."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu_ns, waiting_ns = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu_ns) / 1e9, int(waiting_ns) / 1e9


def involuntary_switches(pid: int) -> int | None:
    """How often process `pid`'s main thread was taken off a CPU while it could still run
    (/proc/PID/status nonvoluntary_ctxt_switches); None where there is no such count. Kept
    by every kernel, unlike schedstat's waiting time (zero where schedstats are off, as on
    the GPU host): switches that grow during a run mean other work took the process's CPU."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def migrations(pid: int) -> int | None:
    """How often process `pid`'s main thread moved to another CPU so far (/proc/PID/sched
    se.nr_migrations, where the kernel has it), else None."""
    try:
        with open(f"/proc/{pid}/sched") as f:
            for line in f:
                if line.startswith("se.nr_migrations"):
                    return int(line.split(":")[1])
    except (OSError, ValueError):
        return None
    return None


@contextlib.contextmanager
def engine_cpu_use(pid: int | None):
    """Fills the yielded dict, on exit, with the engine process's CPU seconds, run-queue
    waiting seconds and involuntary context switches over the block, its moves to another
    CPU and the CPU it ran on last (nothing when `pid` is None or /proc has no schedstat)."""
    found: dict[str, float] = {}
    before = cpu_and_wait_s(pid) if pid else None
    switches = involuntary_switches(pid) if before else None
    moves = migrations(pid) if before else None
    yield found
    after = cpu_and_wait_s(pid) if before else None
    if after:
        found.update(engine_process_cpu_s=after[0] - before[0], engine_process_runqueue_wait_s=after[1] - before[1])
        now = involuntary_switches(pid)
        if switches is not None and now is not None:
            found["engine_process_involuntary_switches"] = now - switches
        moved = migrations(pid)
        if moves is not None and moved is not None:
            found["engine_process_migrations"] = moved - moves


ENGINE_TIME_METRICS = ("roseray:engine_steps_total", "roseray:engine_step_seconds_total",
                       "roseray:engine_output_seconds_total")


def metric_totals(text: str, names) -> dict[str, float]:
    """Each metric of `names` on a /metrics page, summed over its label sets; a name the
    page lacks is left out."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        if name in names:
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def engine_time_from_metrics(text: str) -> tuple[float, float, float] | None:
    """(steps, seconds in steps, seconds sending outputs) from a /metrics page, or None."""
    totals = metric_totals(text, ENGINE_TIME_METRICS)
    return tuple(totals[name] for name in ENGINE_TIME_METRICS) if len(totals) == len(ENGINE_TIME_METRICS) else None


def engine_time_split(before, after) -> dict:
    """Where the engine's time went between two (steps, step seconds, output seconds)
    readings: per step, in its steps and in sending their outputs on (empty without both)."""
    if before is None or after is None or after[0] <= before[0]:
        return {}
    steps = after[0] - before[0]
    return {"engine_steps": int(steps), "engine_step_us": (after[1] - before[1]) / steps * 1e6,
            "engine_output_us": (after[2] - before[2]) / steps * 1e6}


# the server's histograms whose means split a client's time to first token, and how late its
# API processes read the engine's step messages
SERVER_TIME_METRICS = ("roseray:time_to_first_token_seconds", "roseray:request_queue_time_seconds",
                       "roseray:engine_message_delay_seconds")


def histogram_totals(text: str, names=SERVER_TIME_METRICS) -> dict[str, tuple[float, float]]:
    """{name: (sum, count)} of each histogram `names` on a /metrics page, over all its
    label sets; a name the page lacks is left out."""
    totals = metric_totals(text, {name + suffix for name in names for suffix in ("_sum", "_count")})
    return {name: (totals[name + "_sum"], totals[name + "_count"]) for name in names
            if name + "_sum" in totals and name + "_count" in totals}


def server_time_split(before: dict, after: dict) -> dict:
    """The mean time to first token and queue time, in ms, of the requests the server
    finished between two histogram_totals readings, and the mean delay of the engine
    messages read meanwhile (each left out where there was none)."""
    found = {}
    for name, key in zip(SERVER_TIME_METRICS, ("server_ttft_mean_ms", "server_queue_mean_ms",
                                               "message_delay_mean_ms")):
        if name in before and name in after and after[name][1] > before[name][1]:
            found[key] = (after[name][0] - before[name][0]) / (after[name][1] - before[name][1]) * 1e3
    return found


def resolve_loop(loop: str) -> str:
    """"auto" -> "uvloop" when it is installed (as uvicorn's loop="auto" picks), else "asyncio"."""
    if loop == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return loop


def new_runner(loop: str = "auto") -> asyncio.Runner:
    """An asyncio.Runner on the named event loop ("asyncio", "uvloop" or "auto"): one loop
    for several runs (an engine started on it stays bound to it)."""
    if resolve_loop(loop) == "uvloop":
        import uvloop  # optional: only when asked for or installed

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


def run_async(coro, loop: str = "auto"):
    """asyncio.run on the named event loop ("asyncio", "uvloop" or "auto")."""
    with new_runner(loop) as runner:
        return runner.run(coro)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()})"


def write_result(path: str | None, name: str, result: dict) -> Path | None:
    if not path:
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "device": device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "torch": torch.__version__, **result}
    out.write_text(json.dumps(payload, indent=2))
    return out


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 24))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
