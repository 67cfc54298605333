"""Where does a step's time go? Times every engine step of a workload, split into
schedule / prepare+forward / sample / update, with CUDA syncs between the phases (so
the phases do not overlap: use only to find the bottleneck, not to quote throughput).

    python scripts/profile_steps.py --workload nano|seed [--limit N]
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch

from roseray.bench.workloads import NANO_MODEL, SEED_MODEL, nano_workload, seed_workload
from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=["nano", "seed"], default="nano")
    parser.add_argument("--limit", type=int, default=None, help="requests to run")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the profiler then sees each kernel)")
    args = parser.parse_args()
    if args.workload == "nano":
        prompts, params = nano_workload()
        config = EngineConfig(model=NANO_MODEL, max_num_batched_tokens=args.max_num_batched_tokens,
                              enforce_eager=args.enforce_eager)
    else:
        prompts, params = seed_workload()
        config = EngineConfig(model=SEED_MODEL, max_num_seqs=128, enable_prefix_caching=False,
                              enforce_eager=args.enforce_eager)
    if args.limit:
        prompts, params = prompts[: args.limit], params[: args.limit]
    engine = LLMEngine(config)
    engine.add_request("warm", list(range(100, 400)), params[0].__class__(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()

    phases = {"schedule": engine.scheduler.schedule, "run": engine.runner.run, "sample": engine.sampler.launch}
    spent = collections.defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            sync()
            t = time.perf_counter()
            out = fn(*a, **kw)
            sync()
            spent[name] += time.perf_counter() - t
            return out
        return wrapper

    engine.scheduler.schedule = timed("schedule", phases["schedule"])
    engine.runner.run = timed("run", phases["run"])
    engine.sampler.launch = timed("sample", phases["sample"])
    engine.overlap = False  # phases are timed with syncs: nothing overlaps anyway
    for i, (p, s) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, s, stream_text=args.workload == "seed")
    kinds = collections.defaultdict(list)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
    started = time.perf_counter()
    trace = []
    while engine.has_unfinished_requests():
        if len(trace) < 200:
            trace.append((len(engine.scheduler.running), len(engine.scheduler.waiting),
                          engine.block_manager.num_free_blocks))
        if len(kinds["decode"]) == 100:
            profiler.start()
        if len(kinds["decode"]) == 105:
            profiler.stop()
        before = len(engine.scheduler.running)
        t = time.perf_counter()
        engine.step()
        sync()
        dt = time.perf_counter() - t
        kinds["decode" if not engine.scheduler.waiting and before == len(engine.scheduler.running) else "other"].append(dt)
        kinds["ordered"].append(dt)
    wall = time.perf_counter() - started
    all_steps = kinds["decode"] + kinds["other"]
    print("first steps (running, waiting, free blocks):", trace[:40:2], trace[40:200:10])
    print("step ms (first 150, every 5th):", [round(x * 1e3, 1) for x in kinds["ordered"][:150:5]])
    print("capacity", engine.runner.num_blocks, "blocks; startup KV tokens", engine.kv_capacity_tokens)
    total_steps = sum(len(v) for v in kinds.values())
    print(f"{args.workload}: wall {wall:.2f} s, {total_steps} steps, graphs {sorted(engine.runner.graphs)[-3:]}")
    for name, value in spent.items():
        print(f"  {name:<9} {value:7.2f} s  {value / total_steps * 1e3:7.3f} ms/step")
    other = wall - sum(spent.values())
    print(f"  {'update':<9} {other:7.2f} s  {other / total_steps * 1e3:7.3f} ms/step")
    for kind, values in [(k, v) for k, v in kinds.items() if k != "ordered"]:
        print(f"  {kind} steps: {len(values)}, median {np.median(values) * 1e3:.3f} ms, total {sum(values):.2f} s")
    if len(kinds["decode"]) > 105:
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
