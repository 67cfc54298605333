"""How much the host's other busy CPUs slow an engine that nothing else touches.

Issue 4's measure compares one engine behind HTTP with one in-process engine, burst for
burst. Behind HTTP, during a burst, the API processes, HAProxy's threads and the client
processes are busy; in-process, only the engine child and the benchmark's own process are.
This script measures what that alone costs on the host it runs on, with no HTTP at all:

- `vcpu`: a fixed pure-Python loop pinned to each CPU in turn, the rest idle: how far apart
  the CPUs' speeds are (on a KVM guest they share physical cores with other guests).
- `engine`: W-seed bursts (roseray.bench.stream.SeedEngine: 128 streams of 128 tokens by
  default) on one in-process engine while N processes spin pure-Python loops, unpinned (the
  scheduler places them as it places an HTTP path's processes); N takes turns, round by
  round, in alternating order, so each N meets the machine's drift alike.

    python scripts/host_cpu_noise.py [--busy 0 4 8 12] [--rounds 2] [--bursts 3] [--skip-vcpu] [--out noise.json]

Figures from the H100 host are in BENCHMARKS.md ("the host's other busy CPUs").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SPIN = "while True: pass"
LOOP_ITERATIONS = 300_000


def loop_seconds(repeats: int = 5) -> float:
    """The best of `repeats` timings of a fixed pure-Python loop on this process's CPU."""
    best = float("inf")
    for _ in range(repeats):
        started, total = time.perf_counter(), 0
        for i in range(LOOP_ITERATIONS):
            total += i
        best = min(best, time.perf_counter() - started)
    return best


def vcpu_speeds() -> dict[int, float]:
    """{cpu: loop milliseconds} with this process pinned to each CPU in turn."""
    allowed = os.sched_getaffinity(0)
    speeds = {}
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})
            speeds[cpu] = loop_seconds() * 1e3
    finally:
        os.sched_setaffinity(0, allowed)
    return speeds


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def engine_under_load(model: str, num_requests: int, max_tokens: int, engine_args: dict, busy: list[int],
                      rounds: int, bursts: int) -> dict[int, list[dict]]:
    """{N busy processes: [each burst's throughput and per-step engine time]}."""
    from roseray.bench.stream import SeedEngine  # torch and the model: only for this part

    runs: dict[int, list[dict]] = {n: [] for n in busy}
    with SeedEngine(model, num_requests, engine_args, max_tokens=max_tokens) as seed:
        for _ in range(2):
            seed.burst()  # warm-up
        for round_index in range(rounds):
            for count in (busy if round_index % 2 == 0 else busy[::-1]):
                processes = spinners(count)
                try:
                    time.sleep(0.3)  # the spinners are running
                    for _ in range(bursts):
                        run = seed.burst()
                        runs[count].append({"throughput_tok_s": run["throughput_tok_s"],
                                            "engine_us_per_step": run.get("engine_step_us", 0.0)
                                            + run.get("engine_output_us", 0.0)})
                finally:
                    stop(processes)
                time.sleep(0.2)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 4, 8, 12],
                        help="numbers of spinning processes beside the engine (0 first: the baseline)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bursts", type=int, default=3, help="bursts per setting per round")
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--engine-args", type=json.loads, default={"num_kv_blocks": 16384},
                        help="EngineConfig fields as JSON")
    parser.add_argument("--skip-vcpu", action="store_true", help="leave out the per-CPU loop timings")
    parser.add_argument("--skip-engine", action="store_true", help="leave out the engine bursts")
    parser.add_argument("--out", default=None, help="write every figure as JSON here")
    args = parser.parse_args()
    if 0 not in args.busy:
        parser.error("--busy must include 0: the baseline")
    result: dict = {"cpus": os.cpu_count()}
    if not args.skip_vcpu:
        speeds = vcpu_speeds()
        result["vcpu_loop_ms"] = speeds
        fastest = min(speeds.values())
        print("pure-Python loop per CPU, ms: " + " ".join(f"{cpu}:{ms:.1f}" for cpu, ms in speeds.items()))
        print(f"slowest / fastest CPU: {max(speeds.values()) / fastest:.2f}x; "
              f"{sum(ms > 1.25 * fastest for ms in speeds.values())} of {len(speeds)} CPUs >25% slower than the fastest")
    if not args.skip_engine:
        runs = engine_under_load(args.model, args.num_requests, args.max_tokens, args.engine_args, args.busy,
                                 args.rounds, args.bursts)
        result["engine"] = {str(n): r for n, r in runs.items()}
        base = statistics.median(r["throughput_tok_s"] for r in runs[0])
        for count, bursts in runs.items():
            tok_s = statistics.median(r["throughput_tok_s"] for r in bursts)
            per_step = statistics.median(r["engine_us_per_step"] for r in bursts)
            print(f"{count:2d} busy processes: {tok_s:9,.0f} tok/s ({tok_s / base:4.0%} of none), engine "
                  f"{per_step:5.0f} us per step (step + sending), {len(bursts)} bursts")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
