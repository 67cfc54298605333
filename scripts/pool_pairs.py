"""Pool several runs of scripts/ray_vs_inprocess.sh (or http_vs_inprocess.py --interleave) by
setting, to compare settings over many pairs instead of one run's median: a run's median pair
moves by ±10% with the GPU host's drift, so one run decides nothing.

    python scripts/pool_pairs.py old=r/a1,r/a2,r/a3 new=r/b1,r/b2,r/b3 [--json out.json]

Each GROUP=PATH,... names a setting and its runs (a run's $OUT directory or its
ray_vs_inprocess.json). For each setting, over all its warm pairs:
  - pair: the median of the pairs' ratios (HTTP tok/s over in-process tok/s), with a bootstrap
    90% interval of that median, and the share of pairs at 85% or more (issue 4's target);
  - busy: in-process over HTTP engine busy time (steps x (step() + sending) of each burst). What
    the ratio is made of, besides the time before the first step and after the last;
  - steps and time per step: the two factors of busy. The step count alone is not a proxy for
    the ratio: the steps an HTTP burst adds are its last, light ones (BENCHMARKS.md, thirteenth
    session);
  - queue: the HTTP bursts' mean queue time (arrival -> scheduled), TTFT p99, and how often the
    replica's engine process was taken off its CPU (where recorded);
  - host CPU: every process's CPU per HTTP burst by role, the median over the pooled bursts
    (where recorded: roseray/bench/host_cpu.py);
  - order: the pair median of the pairs whose HTTP burst went first and of the others (the
    two take turns), and how far apart a pair's two bursts were (where recorded). A measure
    whose order matters is biased by it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # roseray, installed or not

from roseray.bench.host_cpu import median_host_cpu  # noqa: E402

BOOTSTRAP_ROUNDS = 2000
TARGET = 0.85


def load_run(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "ray_vs_inprocess.json")
    with open(path) as f:
        return json.load(f)


def http_goes_first(index: int) -> bool:
    """Whether pair `index` of http_vs_inprocess.py --interleave sends its HTTP burst first
    (the two sides take turns, HTTP first in pair 0)."""
    return index % 2 == 0


def pair_gap_s(index: int, http: dict, inproc: dict) -> float | None:
    """Seconds from the end of pair `index`'s first burst to the start of its second (None
    for runs that did not record the bursts' start)."""
    first, second = (http, inproc) if http_goes_first(index) else (inproc, http)
    if "started_unix" not in second or "ended_unix" not in first:
        return None
    return second["started_unix"] - first["ended_unix"]


def warm_pairs(run: dict) -> list[dict]:
    """One row per warm pair (the first pass of each side warms up)."""
    rows = []
    for index, (http, inproc) in enumerate(zip(run["http"]["all_passes"], run["in_process"]["all_passes"])):
        if index == 0:
            continue
        gap = pair_gap_s(index, http, inproc)
        per_step_http = http["engine_step_us"] + http["engine_output_us"]
        per_step_inproc = inproc["engine_step_us"] + inproc["engine_output_us"]
        rows.append({
            "pair": http["throughput_tok_s"] / inproc["throughput_tok_s"],
            "busy": (inproc["engine_steps"] * per_step_inproc) / (http["engine_steps"] * per_step_http),
            "steps": inproc["engine_steps"] / http["engine_steps"],
            "step_time": per_step_inproc / per_step_http,
            "http_steps": http["engine_steps"],
            "queue_ms": http.get("server_queue_mean_ms"),
            "ttft_p99_ms": http["ttft_ms"]["p99"],
            "switches": http.get("engine_process_involuntary_switches"),
            "http_first": http_goes_first(index),
            "gap_ms": None if gap is None else gap * 1e3,
        })
    return rows


def bootstrap_median(values: list[float], rounds: int = BOOTSTRAP_ROUNDS, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median of resamples of `values`."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.05 * rounds)], medians[int(0.95 * rounds) - 1]


def _median(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if row[key] is not None]
    return statistics.median(values) if values else None


def pool(runs: list[dict]) -> dict:
    per_run = [warm_pairs(run) for run in runs]
    rows = [row for run_rows in per_run for row in run_rows]
    pairs = [row["pair"] for row in rows]
    low, high = bootstrap_median(pairs)
    summary = {"runs": len(runs), "pairs": len(rows), "pair_median": statistics.median(pairs),
               "pair_median_90": [low, high], "pairs_at_target": sum(p >= TARGET for p in pairs) / len(pairs),
               "run_medians": [statistics.median(row["pair"] for row in run_rows) for run_rows in per_run]}
    for key in ("busy", "steps", "step_time", "http_steps", "queue_ms", "ttft_p99_ms", "switches", "gap_ms"):
        summary[key] = _median(rows, key)
    for key, first in (("pair_median_http_first", True), ("pair_median_in_process_first", False)):
        ordered = [row["pair"] for row in rows if row["http_first"] == first]
        summary[key] = statistics.median(ordered) if ordered else None
    summary["http_host_cpu_ms"] = median_host_cpu([http for run in runs for http in run["http"]["all_passes"][1:]])
    return summary


def _text(name: str, s: dict) -> str:
    optional = "".join(f", {label} {s[key]:{form}}" for key, label, form in
                       (("queue_ms", "queue", ".2f"), ("switches", "engine taken off its CPU", ".0f"),
                        ("pair_median_http_first", "pair median HTTP first", ".1%"),
                        ("pair_median_in_process_first", "in-process first", ".1%"),
                        ("gap_ms", "a pair's bursts apart (ms)", ".0f"))
                       if s[key] is not None)
    runs = " / ".join(f"{m:.0%}" for m in s["run_medians"])
    return (f"{name}: {s['runs']} runs ({runs}), {s['pairs']} pairs: pair median {s['pair_median']:.1%} "
            f"(90% {s['pair_median_90'][0]:.1%}-{s['pair_median_90'][1]:.1%}), {s['pairs_at_target']:.0%} of pairs "
            f">= {TARGET:.0%}; busy {s['busy']:.3f} = steps {s['steps']:.3f} (HTTP {s['http_steps']:.0f}) x time per "
            f"step ~{s['step_time']:.3f}; TTFT p99 {s['ttft_p99_ms']:.1f} ms{optional}"
            + ("\n  host CPU per HTTP burst (median ms): "
               + ", ".join(f"{role} {ms:.0f}" for role, ms in s["http_host_cpu_ms"].items())
               if s["http_host_cpu_ms"] else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("groups", nargs="+", metavar="NAME=PATH,...",
                        help="a setting's name and its runs ($OUT directories or ray_vs_inprocess.json files)")
    parser.add_argument("--json", help="write the summaries here")
    args = parser.parse_args(argv)
    summaries = {}
    for group in args.groups:
        name, sep, paths = group.partition("=")
        if not sep or not paths:
            parser.error(f"{group!r}: give NAME=PATH[,PATH...]")
        summaries[name] = pool([load_run(path) for path in paths.split(",")])
        print(_text(name, summaries[name]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)


if __name__ == "__main__":
    main()
