"""python -m roseray.bench routing-sim: routing policies over N simulated replicas.

For every (workload, replicas, QPS, policy): one seeded simulation (routing_sim.simulate),
a table row (TTFT p50/p90/p99, ITL p99, output tok/s, prefix-cache hit rate, load spread:
max/mean requests per replica), all rows as JSON (--out) and one plot per workload and
replica count (TTFT p90 against offered QPS, a line per policy) under --plot-dir. For the
cache_aware policy (the Router's own, on the replicas' KV events), a second table: the age of
its view of the replicas' caches at its picks (p50/p99/max) and how often that view was wrong.
The step-time model is the hand-derived provisional one unless --step-model loads a GPU fit
(two ship, each of an H100: roseray/bench/fits/h100-qwen3-0.6b.json, the Qwen3-0.6B geometry,
and h100-llama-8b.json, Llama-3.1-8B's); with the 0.6B fit,
--async-scheduling and --serve-stats-timing the simulator matched the Ray app on two H100s
within 25% on TTFT p50/p90 (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from roseray.bench.routing_policies import POLICIES
from roseray.bench.routing_sim import ReplicaConfig, serve_stats_timing, simulate
from roseray.bench.routing_sim_plots import plot_ttft_p90
from roseray.bench.routing_step_time import StepTimeModel
from roseray.bench.routing_workloads import WORKLOADS, ArrivalShape

COLUMNS = [("workload", "{}"), ("replicas", "{}"), ("qps", "{:g}"), ("policy", "{}"), ("ttft_p50_s", "{:.3f}"),
           ("ttft_p90_s", "{:.3f}"), ("ttft_p99_s", "{:.3f}"), ("itl_p99_ms", "{:.1f}"), ("output_tok_s", "{:,.0f}"),
           ("prefix_hit_rate", "{:.1%}"), ("load_spread", "{:.2f}"), ("finished", "{}"), ("wall_s", "{:.1f}")]
VIEW_COLUMNS = [("workload", "{}"), ("replicas", "{}"), ("qps", "{:g}"), ("policy", "{}"), ("view_age_p50_s", "{:.3f}"),
                ("view_age_p99_s", "{:.3f}"), ("view_age_max_s", "{:.3f}"), ("view_missing_rate", "{:.2%}"),
                ("view_over_rate", "{:.2%}"), ("view_under_rate", "{:.2%}")]


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m roseray.bench routing-sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", type=_csv(str), default=["multi-tenant"], help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--policies", type=_csv(str), default=list(POLICIES), help=f"of {', '.join(POLICIES)}")
    p.add_argument("--replicas", type=_csv(int), default=[16])
    p.add_argument("--qps-per-replica", type=_csv(float), default=[4.0, 6.0, 8.0, 10.0],
                   help="offered load points, per replica (x replicas = QPS)")
    p.add_argument("--duration", type=float, default=60.0, help="simulated seconds of arrivals per point")
    p.add_argument("--ramp", type=float, default=0.25, help="the rate ramps from 10%% to full over this fraction")
    p.add_argument("--tenants-per-replica", type=float, default=150 / 16,
                   help="multi-tenant: tenants = this x replicas (llm-d: 150 over 16 replicas)")
    p.add_argument("--prefix-tokens", type=int, default=6000)
    p.add_argument("--kv-blocks", type=int, default=ReplicaConfig.num_blocks, help="per replica, of 16 tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=ReplicaConfig.max_num_batched_tokens)
    p.add_argument("--async-scheduling", action="store_true",
                   help="each replica schedules its next step while the current one runs (as the engine on a "
                        "GPU): an arrival at a busy replica waits one step longer")
    p.add_argument("--stats-period", type=float, default=0.5, help="seconds between routing-stats pulls")
    p.add_argument("--serve-stats-timing", action="store_true",
                   help="stats pulled and delivered with Ray Serve's controller's timing (routing_sim.py), "
                        "not every period exactly and at once")
    p.add_argument("--kv-snapshot-every", type=int, default=20,
                   help="cache_aware: a replica sends a full cache snapshot every this many stats periods")
    p.add_argument("--step-model", help="JSON of StepTimeModel coefficients (a GPU fit); default: provisional")
    p.add_argument("--exact-queue-tokens", type=int, default=512,
                   help="exact: a queued request weighs as the prefill of this many uncached tokens")
    p.add_argument("--drain", type=float, default=3.0, help="stop at this x duration if requests remain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write all rows as JSON here")
    p.add_argument("--plot-dir", help="write routing_sim_<workload>_<replicas>.png here")
    return p.parse_args(argv)


def make_workload(name: str, shape: ArrivalShape, replicas: int, args: argparse.Namespace):
    if name == "multi-tenant":
        tenants = max(1, round(args.tenants_per_replica * replicas))
        return WORKLOADS[name](shape, tenants=tenants, prefix_tokens=args.prefix_tokens, seed=args.seed)
    return WORKLOADS[name](shape, seed=args.seed)


def format_table(rows: list[dict], columns: list[tuple[str, str]] = COLUMNS) -> str:
    head = "| " + " | ".join(name for name, _ in columns) + " |"
    lines = [head, "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[name]) for name, fmt in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    unknown = [n for n in args.workloads if n not in WORKLOADS] + [n for n in args.policies if n not in POLICIES]
    if unknown:
        raise SystemExit(f"unknown workload or policy: {unknown}")
    model = StepTimeModel.from_json(args.step_model) if args.step_model else StepTimeModel()
    config = ReplicaConfig(num_blocks=args.kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                           async_scheduling=args.async_scheduling)
    rows, started = [], time.perf_counter()
    timing = serve_stats_timing(args.stats_period) if args.serve_stats_timing else {}
    for workload_name in args.workloads:
        for replicas in args.replicas:
            for per_replica in args.qps_per_replica:
                qps = per_replica * replicas
                shape = ArrivalShape(qps, args.duration, ramp_s=args.ramp * args.duration)
                workload = make_workload(workload_name, shape, replicas, args)
                for policy_name in args.policies:
                    policy = POLICIES[policy_name](seed=args.seed, model=model, queue_tokens=args.exact_queue_tokens)
                    result = simulate(workload, policy, replicas, qps=qps, config=config, model=model,
                                      stats_period_s=args.stats_period, max_sim_s=args.drain * args.duration,
                                      seed=args.seed, kv_snapshot_every=args.kv_snapshot_every, **timing)
                    row = result.summary()
                    rows.append(row)
                    print(format_table([row]).splitlines()[-1], flush=True)
    print(f"\nstep-time model: {model.source}\n")
    print(format_table(rows))
    viewed = [row for row in rows if "view_age_p99_s" in row]
    if viewed:
        print("\nthe Router's view of the replicas' caches (cache_aware), at its picks:\n")
        print(format_table(viewed, VIEW_COLUMNS))
    print(f"\n{len(rows)} simulations in {time.perf_counter() - started:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"step_time_model": asdict(model), "rows": rows}, indent=2) + "\n")
    if args.plot_dir:
        label = fit_label(model) if model.fit_points else "provisional step-time model"
        for path in plot_ttft_p90(rows, args.plot_dir, label):
            print(f"plot: {path}")
    return 0


def fit_label(model: StepTimeModel) -> str:
    """"step-time fit: llama-8b, 27 points": the fit's source up to the model's details."""
    return f"{model.source.split(' (')[0]}, {model.fit_points} points"
