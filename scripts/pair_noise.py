"""An A/A test of the interleaved pairs of scripts/http_vs_inprocess.py: how far apart two
identical in-process engines come out, pair by pair, on this host.

Issue 4's measure pairs each HTTP burst with an in-process burst and takes the median of
the pairs' ratios. Here both sides are the same: two SeedEngines (W-seed, one engine
process each, as the in-process side), taking turns at going first, with `gap` seconds
between a pair's two bursts. The ratios' spread is what the host alone puts into a pair,
and their median should be 1.0: anything else is a bias of the design itself (which burst
goes first, which engine started first). Each gap in `--gap-s` gets `--pairs` pairs; gaps
take turns, pair by pair, so each meets the host's drift alike.

    python scripts/pair_noise.py [--pairs 24] [--gap-s 0 3] [--out pair_noise.json]

On the H100 host (BENCHMARKS.md, fifteenth session) two identical engines came out 3% apart
at the median back to back, 22% three seconds apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from roseray.bench.stream import SeedEngine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pool_pairs import bootstrap_median  # noqa: E402


def summary(ratios: list[float]) -> dict:
    low, high = bootstrap_median(ratios)
    q1, median, q3 = np.percentile(ratios, [25, 50, 75])
    return {"pairs": len(ratios), "median": float(median), "q1": float(q1), "q3": float(q3),
            "median_ci90": [low, high], "median_abs_log_ratio": float(np.median(np.abs(np.log(ratios))))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=24, help="pairs per gap (after one warm-up pair)")
    parser.add_argument("--gap-s", type=float, nargs="+", default=[0.0, 3.0],
                        help="seconds between a pair's two bursts (scripts/http_vs_inprocess.py --interleave "
                             "has ~0.1-3 s: the server's metrics are read between them)")
    parser.add_argument("--engine-args", type=json.loads, default={"num_kv_blocks": 16384})
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = (args.model, args.num_requests, args.engine_args)
    with SeedEngine(*sizes, max_tokens=args.max_tokens) as a, SeedEngine(*sizes, max_tokens=args.max_tokens) as b:
        a.burst(), b.burst()  # warm-up
        pairs: dict[float, list[dict]] = {gap: [] for gap in args.gap_s}
        for index in range(args.pairs * len(args.gap_s)):
            gap = args.gap_s[index % len(args.gap_s)]
            a_first = (index // len(args.gap_s)) % 2 == 0
            first, second = (a, b) if a_first else (b, a)
            one = first.burst()
            time.sleep(gap)
            two = second.burst()
            run_a, run_b = (one, two) if a_first else (two, one)
            pairs[gap].append({"a": run_a["throughput_tok_s"], "b": run_b["throughput_tok_s"], "a_first": a_first,
                               "a_step_us": run_a.get("engine_step_us"), "b_step_us": run_b.get("engine_step_us")})
    result = {"workload": "W-seed", "model": args.model, "gaps": {}}
    for gap, runs in pairs.items():
        a_over_b = summary([r["a"] / r["b"] for r in runs])
        order = summary([r["a"] / r["b"] if r["a_first"] else r["b"] / r["a"] for r in runs])
        result["gaps"][str(gap)] = {"a_over_b": a_over_b, "first_over_second": order, "pairs": runs}
        print(f"gap {gap:g} s: A/B median {a_over_b['median']:.3f} (quartiles {a_over_b['q1']:.3f}-"
              f"{a_over_b['q3']:.3f}, 90% CI of the median {a_over_b['median_ci90'][0]:.3f}-"
              f"{a_over_b['median_ci90'][1]:.3f}, median |log ratio| {a_over_b['median_abs_log_ratio']:.3f}); "
              f"first / second burst median {order['median']:.3f} (CI {order['median_ci90'][0]:.3f}-"
              f"{order['median_ci90'][1]:.3f}); {len(runs)} pairs")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
