"""Where a burst's time goes, request by request: merges the events that
`ROSERAY_REQUEST_TRACE_DIR` made the load generator, the Routers and the API processes write
(roseray/server/request_trace.py) and prints, for the bursts of scripts/http_vs_inprocess.py:

  - when each event happened, in ms from the burst's first send (the p50 and the last request
    of each burst; the median over the bursts),
  - each leg between two events (p50 / p90 / max per burst; the median over the bursts).

    TRACE=1 PASSES=10 bash scripts/ray_vs_inprocess.sh     # writes $OUT/trace and runs this
    python scripts/burst_timeline.py DIR [--skip 1] [--json out.json]

The first burst warms up (--skip). Requests missing an event are left out (a route through
Serve's own proxy has no Router events); the count of those kept is printed.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics

EVENTS = ("client_sent", "router_accepted", "router_answered", "api_received", "admitted", "client_first_token")


def load(directory: str) -> dict[str, dict[str, float]]:
    """request id -> {event: time} from every file of `directory`."""
    requests: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path) as f:
            for line in f:
                request_id, event, at = json.loads(line)
                requests[request_id][event] = at
    return requests


def bursts(requests: dict[str, dict[str, float]], events=EVENTS) -> dict[int, list[dict[str, float]]]:
    """The load generator's requests ("c<pid>-<burst>-<stream>") with every event, by burst."""
    out: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
    for request_id, times in requests.items():
        parts = request_id.split("-")
        if len(parts) == 3 and parts[0].startswith("c") and all(event in times for event in events):
            out[int(parts[1])].append(times)
    return dict(out)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def timeline(by_burst: dict[int, list[dict[str, float]]], skip: int = 1, events=EVENTS) -> dict:
    """{"at": {event: (p50, last)}, "legs": {"a -> b": (p50, p90, max)}} in ms: each the
    median over the bursts kept of that burst's figure."""
    at, legs = collections.defaultdict(list), collections.defaultdict(list)
    kept = [by_burst[b] for b in sorted(by_burst)[skip:]]
    for requests in kept:
        start = min(r[events[0]] for r in requests)
        for event in events[1:]:
            since = [(r[event] - start) * 1e3 for r in requests]
            at[event].append((_quantile(since, 0.5), max(since)))
        for first, then in zip(events, events[1:]):
            spans = [(r[then] - r[first]) * 1e3 for r in requests]
            legs[f"{first} -> {then}"].append((_quantile(spans, 0.5), _quantile(spans, 0.9), max(spans)))

    def medians(rows):
        return tuple(round(statistics.median(column), 2) for column in zip(*rows))

    return {"bursts": len(kept), "requests": sum(len(r) for r in kept),
            "at": {event: medians(rows) for event, rows in at.items()},
            "legs": {leg: medians(rows) for leg, rows in legs.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--skip", type=int, default=1, help="leading bursts to leave out (warm-up)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    by_burst = bursts(load(args.directory))
    if len(by_burst) <= args.skip:
        print(f"no traced bursts with every event in {args.directory} (is ROSERAY_REQUEST_TRACE_DIR set "
              "where Ray starts, and does each request pass a Router?)")
        return 1
    result = timeline(by_burst, args.skip)
    print(f"{result['bursts']} bursts, {result['requests']} requests with every event; ms from each burst's first send")
    print(f"{'event':20s} {'p50':>7s} {'last':>7s}")
    for event, (p50, last) in result["at"].items():
        print(f"{event:20s} {p50:7.2f} {last:7.2f}")
    print(f"{'leg':40s} {'p50':>7s} {'p90':>7s} {'max':>7s}")
    for leg, (p50, p90, worst) in result["legs"].items():
        print(f"{leg:40s} {p50:7.2f} {p90:7.2f} {worst:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
