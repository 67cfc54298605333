"""Exact samples of a locust run against roseray, merged across locust processes, and the
JSON summary written at the end (percentiles from every sample; locust's own tables round
response times into buckets).

`SampleBook` holds one process's samples per replica in compact arrays; `drain()` turns
them into a message (bytes, for locust's master/worker messaging) and `merge()` takes
one in. `summarize()` computes the report; `write_report()` writes summary.json and the
plots (roseray.bench.locust_plots). Times are wall-clock seconds (time.time()), so that
samples from several processes line up; durations are seconds inside, milliseconds in
the report.

    python -m roseray.bench.locust_report runs/*/summary.json [--per-replica]

prints the runs side by side as a markdown table (a request-rate sweep: find the knee).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from roseray.bench.sse_stream import StreamResult

try:  # plots need matplotlib (the bench extra); without it the summary is still written
    from roseray.bench import locust_plots
except ImportError:  # pragma: no cover - exercised where matplotlib is absent (the GPU host's bundle)
    locust_plots = None

PERCENTILES = (50, 90, 95, 99, 99.9)
SCHEMA = "roseray-locust-report/1"
# A load process is CPU-bound when it spent CPU_BUSY_SHARE of the run at >= 90% of a core
# (or locust warned); its timestamps are late when its event loop woke more than
# LOOP_LAG_P99_LIMIT_MS late (p99) from a short sleep: every time it takes can be that late.
CPU_BUSY_PERCENT = 90.0
CPU_BUSY_SHARE = 0.10
LOOP_LAG_P99_LIMIT_MS = 5.0

# Per replica: request-aligned fields (one value per good request), then the rest.
_REQUEST_FIELDS = {"sent_at": "d", "ttft": "d", "e2e": "d", "prompt_tokens": "q", "output_tokens": "q",
                   "chunks": "q"}
_OTHER_FIELDS = {"tpot": "d", "itl": "d", "itl_at": "d", "chunk_tokens": "q"}
_FIELDS = {**_REQUEST_FIELDS, **_OTHER_FIELDS}
_MAX_FAILURE_EXAMPLES = 20


def _new_replica() -> dict[str, array]:
    return {name: array(code) for name, code in _FIELDS.items()}


class SampleBook:
    """The samples of one process (or, on the master, of all of them)."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, array]] = {}
        self.sent_at = array("d")  # every request sent inside the measured window, good or not
        self.arrival_lag = array("d")  # open loop: send time - scheduled time (s)
        self.failures: Counter[tuple[int, str]] = Counter()  # (status, kind) -> count
        self.failure_examples: list[str] = []
        self.warmup_requests = 0
        self.unknown_chunk_tokens = 0  # good requests whose stream had no per-chunk token counts

    # ---- recording ------------------------------------------------------------------------------
    def on_sent(self, sent_at: float, arrival_lag: float | None) -> None:
        self.sent_at.append(sent_at)
        if arrival_lag is not None:
            self.arrival_lag.append(arrival_lag)

    def on_result(self, replica: str, sent_at: float, t_sent: float, result: StreamResult) -> None:
        """Record one finished request. `t_sent` is the stream clock's send time, `sent_at`
        the same instant on the wall clock."""
        if not result.ok:
            self.on_failure(result.status, result.error or "failure", result.detail, replica)
            return
        r = self.replicas.get(replica)
        if r is None:
            r = self.replicas[replica] = _new_replica()
        r["sent_at"].append(sent_at)
        r["ttft"].append(result.ttft)
        r["e2e"].append(result.e2e)
        r["prompt_tokens"].append(result.prompt_tokens or 0)
        r["output_tokens"].append(result.completion_tokens or 0)
        r["chunks"].append(len(result.chunk_times))
        if result.tpot is not None:
            r["tpot"].append(result.tpot)
        times = result.chunk_times
        offset = sent_at - t_sent
        for a, b in zip(times, times[1:]):
            r["itl"].append(b - a)
            r["itl_at"].append(b + offset)
        if result.chunk_tokens is not None:
            r["chunk_tokens"].extend(result.chunk_tokens)
        else:
            self.unknown_chunk_tokens += 1

    def on_failure(self, status: int, kind: str, detail: str = "", replica: str | None = None) -> None:
        self.failures[(int(status), kind)] += 1
        where = f" [{replica}]" if replica else ""
        example = f"{status} {kind}{where}: {detail}"[:300]
        if len(self.failure_examples) < _MAX_FAILURE_EXAMPLES and example not in self.failure_examples:
            self.failure_examples.append(example)

    # ---- moving between processes ---------------------------------------------------------------
    def drain(self) -> dict[str, Any]:
        """Everything recorded since the last drain, as plain types (arrays as bytes); resets."""
        payload = {
            "replicas": {name: {f: a.tobytes() for f, a in fields.items()} for name, fields in self.replicas.items()},
            "sent_at": self.sent_at.tobytes(), "arrival_lag": self.arrival_lag.tobytes(),
            "failures": [[status, kind, n] for (status, kind), n in self.failures.items()],
            "failure_examples": list(self.failure_examples), "warmup_requests": self.warmup_requests,
            "unknown_chunk_tokens": self.unknown_chunk_tokens,
        }
        self.__init__()
        return payload

    def merge(self, payload: dict[str, Any]) -> None:
        for name, fields in payload["replicas"].items():
            r = self.replicas.get(name)
            if r is None:
                r = self.replicas[name] = _new_replica()
            for f, raw in fields.items():
                r[f].frombytes(raw)
        self.sent_at.frombytes(payload["sent_at"])
        self.arrival_lag.frombytes(payload["arrival_lag"])
        for status, kind, n in payload["failures"]:
            self.failures[(int(status), kind)] += n
        for example in payload["failure_examples"]:
            if len(self.failure_examples) < _MAX_FAILURE_EXAMPLES and example not in self.failure_examples:
                self.failure_examples.append(example)
        self.warmup_requests += payload["warmup_requests"]
        self.unknown_chunk_tokens += payload["unknown_chunk_tokens"]

    # ---- views ----------------------------------------------------------------------------------
    def field(self, name: str, replica: str | None = None) -> np.ndarray:
        """One field as float64, of one replica or of all replicas together."""
        names = [replica] if replica is not None else sorted(self.replicas)
        dtype = np.float64 if _FIELDS[name] == "d" else np.int64
        parts = [np.frombuffer(self.replicas[n][name], dtype=dtype) for n in names if n in self.replicas]
        return np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)


class ClientMonitor:
    """One load process's own CPU use and event-loop lag, sampled by the locustfile."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.pid = os.getpid()
        self.cpu_percent = array("d")
        self.loop_lag = array("d")  # s late waking from a short sleep
        self.interval_s = 0.0
        self.locust_cpu_warning = False

    def summary(self) -> dict[str, Any]:
        cpu = np.frombuffer(self.cpu_percent, dtype=np.float64)
        lag_ms = np.frombuffer(self.loop_lag, dtype=np.float64) * 1e3
        busy = float(np.mean(cpu >= CPU_BUSY_PERCENT)) if cpu.size else 0.0
        return {
            "process": self.role, "pid": self.pid, "cpu_samples": int(cpu.size),
            "cpu_percent": _stats(cpu, (50, 90)) if cpu.size else None,
            "share_at_or_above_90_percent": round(busy, 4),
            "loop_lag_ms": _stats(lag_ms, (50, 99)) if lag_ms.size else None,
            "locust_cpu_warning": self.locust_cpu_warning,
        }


def client_verdict(processes: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the load generator was the bottleneck (CPU-bound), and whether its
    timestamps were late (event-loop lag: a busy client process, or a machine whose cores
    the client shares with something busier, such as the server itself)."""
    cpu, lag = [], []
    for p in processes:
        name = f"{p['process']} (pid {p['pid']})"
        if p.get("locust_cpu_warning"):
            cpu.append(f"{name}: locust warned that its CPU usage went above 90%")
        if p.get("share_at_or_above_90_percent", 0) >= CPU_BUSY_SHARE:
            cpu.append(f"{name}: at >= 90% CPU for {100 * p['share_at_or_above_90_percent']:.0f}% of the run")
        loop = p.get("loop_lag_ms")
        if p["process"] != "master" and loop and loop["p99"] > LOOP_LAG_P99_LIMIT_MS:  # the master takes no times
            lag.append(f"{name}: event loop lag p99 {loop['p99']:.1f} ms (> {LOOP_LAG_P99_LIMIT_MS:g} ms), max "
                       f"{loop['max']:.1f} ms: client timestamps are late by up to that")
    return {"cpu_bound": bool(cpu), "cpu_bound_reasons": cpu, "timestamps_late": bool(lag),
            "timestamps_late_reasons": lag}


def _stats(values: np.ndarray, qs=PERCENTILES, scale: float = 1.0) -> dict[str, float] | None:
    """count, mean, min, max and percentiles (numpy's linear interpolation) of `values * scale`."""
    if values.size == 0:
        return None
    v = values * scale
    out: dict[str, float] = {"count": int(v.size), "mean": float(v.mean()), "min": float(v.min()),
                             "max": float(v.max())}
    for q, p in zip(qs, np.percentile(v, qs)):
        out[f"p{q:g}"] = float(p)
    return out


def _metrics(book: SampleBook, replica: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": int(book.field("ttft", replica).size)}
    for name in ("ttft", "itl", "tpot", "e2e"):
        out[f"{name}_ms"] = _stats(book.field(name, replica), scale=1e3)
    output = book.field("output_tokens", replica)
    chunks = book.field("chunks", replica)
    out["output_tokens"] = int(output.sum())
    out["prompt_tokens"] = _stats(book.field("prompt_tokens", replica), qs=(50,))
    itl = book.field("itl", replica)
    out["itl_zero_gaps"] = {
        "count": int(np.sum(itl == 0)), "share": float(np.mean(itl == 0)) if itl.size else None,
        "note": "content chunks that arrived in the same read as the previous one (written together, or read late)"}
    per_chunk = book.field("chunk_tokens", replica)
    out["tokens_per_chunk"] = {
        "mean": float(output.sum() / chunks.sum()) if chunks.sum() else None,
        "max": int(per_chunk.max()) if per_chunk.size else None,
        "share_of_chunks_with_more_than_one": float(np.mean(per_chunk > 1)) if per_chunk.size else None,
        "source": "continuous usage (exact per chunk)" if per_chunk.size else "usage / content chunks",
    }
    return out


def summarize(book: SampleBook, *, window: tuple[float, float], options: dict[str, Any],
              processes: list[dict[str, Any]], workers: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report. `window` is (start of measurement, when stopping began) on the wall
    clock; `options` the run's settings (recorded as given)."""
    start, stop = window
    sending_s = max(stop - start, 1e-9)
    sent_at = np.frombuffer(book.sent_at, dtype=np.float64)
    finish = book.field("sent_at") + book.field("e2e")
    last_finish = float(finish.max()) if finish.size else stop
    output_tokens = int(book.field("output_tokens").sum())
    num_good = int(book.field("ttft").size)
    num_failed = sum(book.failures.values())
    by_status: Counter[str] = Counter()
    for (status, _), n in book.failures.items():
        by_status[str(status)] += n
    verdict = client_verdict(processes)
    lag_ms = np.frombuffer(book.arrival_lag, dtype=np.float64) * 1e3
    warnings = verdict["cpu_bound_reasons"] + verdict["timestamps_late_reasons"]
    unfinished = int(sent_at.size) - num_good - num_failed
    if unfinished > 0:
        warnings.append(f"{unfinished} request(s) were still streaming when the run ended and are in no metric "
                        "(raise --drain-timeout)")
    if lag_ms.size and np.mean(lag_ms > 10) > 0.01:
        warnings.append(f"{100 * np.mean(lag_ms > 10):.1f}% of arrivals went out > 10 ms late: too few users "
                        "(-u caps the requests in flight) or a busy client; the load was not open-loop Poisson")
    prompt = book.field("prompt_tokens")
    asked = options.get("prompt_tokens")
    if prompt.size and isinstance(asked, (list, tuple)):
        mid = (asked[0] + asked[1]) / 2
        every, long_range = options.get("long_prompt_every") or 0, options.get("long_prompt_tokens")
        if every > 0 and isinstance(long_range, (list, tuple)):
            mid = (1 - 1 / every) * mid + (long_range[0] + long_range[1]) / 2 / every
        if not 0.75 * mid <= prompt.mean() <= 1.33 * mid + 64:  # + 64: chat template tokens
            warnings.append(f"prompts averaged {prompt.mean():.0f} tokens (server usage) for a requested mean of "
                            f"{mid:.0f}: pick --prompt-style for this tokenizer (chars for byte-level random:*)")
    if workers and workers.get("missing"):
        warnings.append(f"no final samples from worker(s) {workers['missing']}: their last seconds are missing")
    return {
        "schema": SCHEMA,
        "options": options,
        "window": {"start": start, "stop": stop, "sending_s": sending_s, "last_finish": last_finish},
        "requests": {"sent": int(sent_at.size), "succeeded": num_good, "failed": num_failed,
                     "unfinished_at_end": max(unfinished, 0), "warmup_excluded": book.warmup_requests},
        "request_rate": {"target": options.get("request_rate") if options.get("arrival") == "poisson" else None,
                         "sent_per_s": sent_at.size / sending_s, "succeeded_per_s": num_good / sending_s},
        "throughput": {"output_tokens": output_tokens,
                       "output_tokens_per_s": output_tokens / max(last_finish - start, 1e-9),
                       "note": "output tokens of good requests / (last finish - start of measurement)"},
        "arrival_lag_ms": _stats(lag_ms, (50, 99)) if lag_ms.size else None,
        "total": _metrics(book, None),
        "replicas": {name: _metrics(book, name) for name in sorted(book.replicas)},
        "failures": {
            "total": num_failed,
            "by_status": dict(sorted(by_status.items())),
            "by_reason": {f"{s} {k}": n for (s, k), n in sorted(book.failures.items())},
            "examples": book.failure_examples,
        },
        "client": {**verdict, "processes": processes, "workers": workers},
        "warnings": warnings,
        "percentiles": "numpy linear interpolation over every sample; ms",
    }


def write_report(book: SampleBook, out_dir: str | os.PathLike, summary: dict[str, Any],
                 save_samples: bool = False) -> dict[str, Any]:
    """Write summary.json and the plots into `out_dir`; returns the summary with its file names."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"summary": str(out / "summary.json")}
    itl = {name: book.field("itl", name) * 1e3 for name in sorted(book.replicas)}
    itl_at = {name: book.field("itl_at", name) for name in sorted(book.replicas)}
    title = _plot_title(summary)
    if locust_plots is not None:
        files["itl_cdf"] = str(locust_plots.plot_itl_cdf(itl, out / "itl_cdf.png", title))
        files["itl_over_time"] = str(locust_plots.plot_itl_over_time(itl, itl_at, summary["window"]["start"],
                                                                     out / "itl_over_time.png", title))
    else:
        summary = {**summary, "warnings": [*summary.get("warnings", []),
                                           "matplotlib is not installed: no plots (pip install -e '.[bench]')"]}
    if save_samples:
        arrays = {f"{name}/{f}": book.field(f, name) for name in book.replicas for f in _FIELDS}
        np.savez_compressed(out / "samples.npz", **arrays)
        files["samples"] = str(out / "samples.npz")
    summary = {**summary, "files": files, "written_at": time.time()}
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=2, default=_json_default)
    return summary


def _plot_title(summary: dict[str, Any]) -> str:
    o = summary["options"]
    rate = f"{o.get('request_rate')} req/s Poisson" if o.get("arrival") == "poisson" else "closed loop"
    return (f"{o.get('api')} · {rate} · prompt {o.get('prompt_tokens')} · output {o.get('output_tokens')} · "
            f"{summary['requests']['succeeded']} requests")


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return None if math.isnan(value) else float(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ---- comparing runs: python -m roseray.bench.locust_report runs/*/summary.json ---------------------------
_COLUMNS = (("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"), ("ITL p50", "itl_ms", "p50"),
            ("ITL p99", "itl_ms", "p99"), ("ITL p99.9", "itl_ms", "p99.9"), ("TPOT p50", "tpot_ms", "p50"),
            ("TPOT p99", "tpot_ms", "p99"), ("E2E p99", "e2e_ms", "p99"))


def table(summaries: list[dict[str, Any]], per_replica: bool = False) -> str:
    """A markdown table of runs (e.g. a sweep of the request rate), one row per run and,
    with `per_replica`, one more per replica. Latencies in ms; req/s: sent (all), or
    succeeded (a replica)."""
    head = ["run", "replica", "target req/s", "req/s", "out tok/s", *[c[0] for c in _COLUMNS],
            "ITL p99/p50", "failed", "client"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        groups = [("all", s["total"])] + (list(s["replicas"].items()) if per_replica else [])
        client = ("CPU-bound" if s["client"]["cpu_bound"] else "") + \
            (" late timestamps" if s["client"].get("timestamps_late") else "")
        for name, m in groups:
            cells = [f"{m[metric][q]:.2f}" if m.get(metric) else "-" for _, metric, q in _COLUMNS]
            itl = m.get("itl_ms")
            ratio = f"{itl['p99'] / itl['p50']:.2f}" if itl and itl["p50"] > 0 else "-"
            target, window = s["request_rate"]["target"], s["window"]
            rate = s["request_rate"]["sent_per_s"] if name == "all" else m["requests"] / window["sending_s"]
            tokens_per_s = m["output_tokens"] / max(window["last_finish"] - window["start"], 1e-9)
            lines.append("| " + " | ".join([
                s.get("files", {}).get("summary", "?"), name, "closed" if target is None else f"{target:g}",
                f"{rate:.2f}", f"{tokens_per_s:.0f}", *cells,
                ratio, str(s["failures"]["total"]), client.strip() or "ok"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.bench.locust_report",
                                     description="tabulate the summary.json files of locust runs (markdown)")
    parser.add_argument("summaries", nargs="+", help="summary.json files, e.g. runs/*/summary.json")
    parser.add_argument("--per-replica", action="store_true", help="a row per replica as well")
    args = parser.parse_args(argv)
    summaries = []
    for path in args.summaries:
        with open(path) as f:
            summaries.append(json.load(f))
    summaries.sort(key=lambda s: (s["request_rate"]["target"] is None, s["request_rate"]["target"] or 0))
    print(table(summaries, args.per_replica))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
