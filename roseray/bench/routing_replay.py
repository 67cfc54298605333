"""Replay routing-sim's workload against a real OpenAI-compatible server, and compare.

    python -m roseray.bench routing-replay --url http://127.0.0.1:8000 --qps 8 --duration 60 \\
        --compare-sim --replicas 2 --policy cache_aware --step-model fit.json --kv-blocks 4096

The requests are exactly the simulator's (routing_workloads.py, same classes and seeds): each
is sent at its arrival time as a streamed /v1/completions of its prompt's token ids, with
max_tokens the spec's, ignore_eos, temperature 0 and usage at the end. Per request the client
times TTFT (send to first content event) and every gap between content events (ITL); output
tok/s is the tokens received over the time from the first arrival to the last token. The
summary has routing-sim's keys (SimResult.summary): the load spread comes from the answers'
x-roseray-replica header (engine replicas, whichever API process answered); the prefix-cache
hit rate is not seen from outside (nan).

Workloads: multi-tenant and no-sharing. Multi-turn is not replayed: a turn's prompt holds the
previous turn's answer, and roseray's completions do not return token ids (return_token_ids
is refused) to rebuild it from.

--compare-sim runs simulate() on the same workload with the server's replica count, policy
(its router.policy: kv_queue is the simulator's `approximate`, the body-hash affinity it
has), KV blocks per replica, token budget and the step-time model (a GPU fit), with Ray
Serve's stats timing and the engine's async scheduling, and prints simulated vs measured TTFT
p50/p90/p99, ITL p99 and output tok/s, PASS when TTFT p50 and p90 are within --tolerance (25%)
of the measurement. The simulator has no HTTP: every simulated TTFT gets the server's own
latency, measured before the replay (the idle server's TTFT of a 4-token prompt, median of
--warmup requests, less the simulated time of that request's step).

--measured replay.json compares again without a server: the saved measurement and workload,
simulated with this invocation's --step-model and --async-scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from tqdm.auto import tqdm

from roseray.bench.routing_policies import POLICIES
from roseray.bench.routing_sim import ReplicaConfig, SimResult, serve_stats_timing, simulate
from roseray.bench.routing_sim_cli import COLUMNS, format_table
from roseray.bench.routing_step_time import StepTimeModel
from roseray.bench.routing_workloads import VOCAB, ArrivalShape, MultiTenantWorkload, NoSharingWorkload
from roseray.bench.stream_connection import StreamConnection, encode_post

REPLICA_HEADER = "x-roseray-replica"
SERVER_POLICIES = {"kv_queue": "approximate", "power_of_two": "power_of_two", "cache_aware": "cache_aware"}
COMPARED = [("ttft_p50_s", "{:.3f}"), ("ttft_p90_s", "{:.3f}"), ("ttft_p99_s", "{:.3f}"), ("itl_p99_ms", "{:.1f}"),
            ("output_tok_s", "{:,.0f}")]
CHECKED = ("ttft_p50_s", "ttft_p90_s")
PREPARE_S = 0.05  # a request's body is built this long before its arrival time
COLUMNS_REPLAY = [c for c in COLUMNS if c[0] != "wall_s"]


@dataclass
class Sent:
    """One request as the client saw it (times: time.monotonic)."""

    arrival: float
    max_tokens: int
    sent: float | None = None
    event_times: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    replica: str | None = None
    error: str | None = None


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def make_workload(args: argparse.Namespace):
    shape = ArrivalShape(args.qps, args.duration, ramp_s=args.ramp * args.duration)
    if args.workload == "multi-tenant":
        return MultiTenantWorkload(shape, tenants=args.tenants, prefix_tokens=args.prefix_tokens,
                                   suffix_tokens=args.suffix_tokens, output_tokens=args.output_tokens,
                                   seed=args.seed, vocab=args.vocab)
    prompt = (args.prefix_tokens + args.suffix_tokens[0], args.prefix_tokens + args.suffix_tokens[1])
    return NoSharingWorkload(shape, prompt_tokens=prompt, output_tokens=args.output_tokens, seed=args.seed,
                             vocab=args.vocab)


def served_model(url: str, timeout_s: float = 30.0) -> str:
    """The first model the server lists."""
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout_s) as answer:
        return json.load(answer)["data"][0]["id"]


class Replay:
    """Sends the workload's requests at their arrival times and keeps what came back."""

    def __init__(self, workload, url: str, model: str, request_timeout_s: float) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.workload, self.model, self.request_timeout_s = workload, model, request_timeout_s
        self.sent: dict[str, Sent] = {}
        self.idle_ttft_s: list[float] = []  # the warm-up requests' TTFT, on the idle server

    def body(self, prompt: list[int], max_tokens: int) -> bytes:
        return encode_post(self.host, self.port, "/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}})

    async def _one(self, record: Sent, request: bytes, bar: tqdm) -> None:
        connection = None
        try:
            connection = await StreamConnection.open(self.host, self.port)
            await asyncio.sleep(max(0.0, record.arrival - time.monotonic()))
            record.sent = time.monotonic()
            answer = await asyncio.wait_for(connection.request(request), self.request_timeout_s)
            record.event_times, record.completion_tokens = answer.event_times, answer.completion_tokens
            record.replica = answer.headers.get(REPLICA_HEADER)
            if answer.status != 200:
                record.error = f"HTTP {answer.status}: {answer.body[:200]!r}"
            elif answer.completion_tokens != record.max_tokens:
                record.error = f"{answer.completion_tokens} of {record.max_tokens} tokens"
        except (TimeoutError, OSError, ValueError) as error:
            record.error = f"{type(error).__name__}: {error}"
        finally:
            if connection is not None:
                connection.close()
            bar.update(1)

    async def run(self, warmup: int = 0) -> float:
        """Send everything; returns the monotonic time of arrival 0."""
        for i in range(warmup):  # the HTTP path warmed up, a few blocks of cache used
            connection = await StreamConnection.open(self.host, self.port)
            try:
                sent = time.monotonic()
                answer = await connection.request(self.body([1 + i, 2, 3, 4], 2))
                if answer.event_times:  # the floor under every TTFT: HTTP, routing, one tiny step
                    self.idle_ttft_s.append(answer.event_times[0] - sent)
            finally:
                connection.close()
        specs = self.workload.specs
        start = time.monotonic() + 0.5
        tasks = []
        with tqdm(total=len(specs), desc="replay", unit="req", dynamic_ncols=True) as bar:
            for spec in specs:
                prepare_at = start + spec.arrival_s - PREPARE_S
                await asyncio.sleep(max(0.0, prepare_at - time.monotonic()))
                record = Sent(start + spec.arrival_s, spec.max_tokens)
                self.sent[spec.request_id] = record
                request = self.body(self.workload.prompt_ids(spec), spec.max_tokens)
                tasks.append(asyncio.create_task(self._one(record, request, bar)))
            await asyncio.gather(*tasks)
        return start

    def result(self, start: float, policy: str, replicas: int, qps: float, wall_s: float) -> SimResult:
        """The replay as routing-sim's SimResult (a request without a first token counts the
        time it waited, as the simulator counts one unfinished at its end)."""
        records = list(self.sent.values())
        end = max([r.event_times[-1] for r in records if r.event_times] + [start])
        ttft = [(r.event_times[0] if r.event_times else end) - r.arrival for r in records]
        itl = [b - a for r in records for a, b in zip(r.event_times, r.event_times[1:])]
        finished = [r for r in records if r.error is None]
        per_replica = Counter(engine_replica(r.replica) for r in records if r.replica is not None)
        send_lag = [r.sent - r.arrival for r in records if r.sent is not None]
        return SimResult(
            workload=self.workload.name, policy=policy, replicas=replicas, qps=qps, num_requests=len(records),
            num_finished=len(finished), sim_seconds=end - start, wall_seconds=wall_s, ttft_s=np.asarray(ttft),
            itl_s=np.asarray(itl), output_tokens=sum(r.completion_tokens or 0 for r in records),
            hit_rate=math.nan, requests_per_replica=[per_replica[k] for k in sorted(per_replica)] or [0],
            preemptions=0,
            extra={"errors": [r.error for r in records if r.error][:10],
                   "num_errors": sum(r.error is not None for r in records),
                   "send_lag_p99_ms": float(np.percentile(send_lag, 99) * 1e3) if send_lag else math.nan,
                   "idle_ttft_ms": float(np.median(self.idle_ttft_s) * 1e3) if self.idle_ttft_s else math.nan,
                   "replicas_seen": sorted(per_replica)})


def engine_replica(header: str) -> str:
    """The engine replica of an x-roseray-replica value (`<replica>/api<k>`: the API process too)."""
    return header.split("/", 1)[0]


def compare(simulated: dict, measured: dict, tolerance: float) -> list[dict]:
    rows = []
    for key, _ in COMPARED:
        sim, real = simulated[key], measured[key]
        error = (sim - real) / real if real else math.nan
        checked = key in CHECKED
        rows.append({"metric": key, "simulated": sim, "measured": real, "sim_over_measured": sim / real if real
                     else math.nan, "error": error,
                     "check": ("PASS" if abs(error) <= tolerance else "FAIL") if checked else "-"})
    return rows


def format_comparison(rows: list[dict], formats: dict[str, str]) -> str:
    lines = ["| metric | simulated | measured | sim / measured | check |", "|---|---|---|---|---|"]
    for row in rows:
        fmt = formats[row["metric"]]
        lines.append(f"| {row['metric']} | {fmt.format(row['simulated'])} | {fmt.format(row['measured'])} | "
                     f"{row['sim_over_measured']:.2f} | {row['check']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m roseray.bench routing-replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (e.g. the Ray app's HAProxy)")
    p.add_argument("--model", help="the model id to send (default: the first of the server's /v1/models)")
    p.add_argument("--workload", choices=("multi-tenant", "no-sharing"), default="multi-tenant")
    p.add_argument("--qps", type=float, default=8.0, help="offered requests per second (all replicas)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--ramp", type=float, default=0.25, help="the rate ramps from 10%% to full over this fraction")
    p.add_argument("--tenants", type=int, default=20, help="multi-tenant: shared prefixes")
    p.add_argument("--prefix-tokens", type=int, default=6000, help="a tenant's shared prefix (no-sharing: + suffix)")
    p.add_argument("--suffix-tokens", type=_pair, default=(200, 400), metavar="MIN:MAX")
    p.add_argument("--output-tokens", type=_pair, default=(100, 300), metavar="MIN:MAX")
    p.add_argument("--vocab", type=int, default=VOCAB, help="prompt ids are drawn below this (the model's vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=16,
                   help="tiny requests before the replay (not in the results; their TTFT is the server's latency)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--compare-sim", action="store_true", help="also simulate the same workload and compare")
    p.add_argument("--replicas", type=int, default=2, help="the server's engine replicas")
    p.add_argument("--policy", choices=sorted(SERVER_POLICIES), default="cache_aware",
                   help="the server's router.policy (kv_queue is simulated as `approximate`)")
    p.add_argument("--step-model", help="StepTimeModel JSON (python -m roseray.bench step-time); default: provisional")
    p.add_argument("--kv-blocks", type=int, default=ReplicaConfig.num_blocks, help="the server's num_kv_blocks")
    p.add_argument("--block-size", type=int, default=ReplicaConfig.block_size)
    p.add_argument("--max-num-seqs", type=int, default=ReplicaConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the server's (EngineConfig default)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--stats-period", type=float, default=0.5, help="the server's router.stats_period_s")
    p.add_argument("--kv-snapshot-every", type=int, default=20, help="the server's router.kv_snapshot_every")
    p.add_argument("--async-scheduling", choices=("on", "off"), default="on",
                   help="simulate the engine's async scheduling (on: its default on a GPU)")
    p.add_argument("--measured", metavar="REPLAY_JSON",
                   help="no replay: compare the measurement saved by --out again (its workload and server)")
    p.add_argument("--tolerance", type=float, default=0.25, help="PASS: TTFT p50 and p90 within this of measured")
    p.add_argument("--out", help="write the measured (and simulated) summaries and the comparison as JSON")
    return p.parse_args(argv)


IDLE_PROMPT_TOKENS = 4  # the warm-up requests' prompts


def simulate_same(workload, args: argparse.Namespace, idle_ttft_ms: float) -> dict:
    """The simulator on the replayed workload and server; its TTFTs plus the server's own latency
    (the idle TTFT less the simulated step of that request)."""
    model = StepTimeModel.from_json(args.step_model) if args.step_model else StepTimeModel()
    config = ReplicaConfig(num_blocks=args.kv_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                           async_scheduling=args.async_scheduling == "on")
    policy = POLICIES[SERVER_POLICIES[args.policy]](seed=args.seed, model=model)
    result = simulate(workload, policy, args.replicas, qps=args.qps, config=config, model=model,
                      stats_period_s=args.stats_period, max_sim_s=3 * args.duration + 60, seed=args.seed,
                      kv_snapshot_every=args.kv_snapshot_every, **serve_stats_timing(args.stats_period))
    idle_step_s = model.step_seconds(IDLE_PROMPT_TOKENS, 1, IDLE_PROMPT_TOKENS ** 2 / 2, 0, IDLE_PROMPT_TOKENS)
    server_s = max(0.0, idle_ttft_ms / 1e3 - idle_step_s) if math.isfinite(idle_ttft_ms) else 0.0
    result.ttft_s = result.ttft_s + server_s
    return {**result.summary(), "step_time_model": model.source, "server_latency_ms": server_s * 1e3,
            "async_scheduling": args.async_scheduling}


def saved_measurement(args: argparse.Namespace) -> tuple[argparse.Namespace, dict]:
    """--measured: the saved run's arguments (this invocation's simulator options kept) and measurement."""
    saved = json.loads(Path(args.measured).read_text())
    mine = {key: getattr(args, key) for key in ("step_model", "async_scheduling", "tolerance", "out", "measured")}
    merged = argparse.Namespace(**{**vars(args), **saved["args"], **mine, "compare_sim": True})
    for key in ("suffix_tokens", "output_tokens"):
        setattr(merged, key, tuple(getattr(merged, key)))
    return merged, saved["measured"]


def replay_and_measure(args: argparse.Namespace, workload) -> tuple[dict, int]:
    """Send the workload to the server; its measurement, and how many requests failed."""
    model_id = args.model or served_model(args.url)
    replay = Replay(workload, args.url, model_id, args.request_timeout)
    print(f"{workload.name}: {len(workload.specs)} requests over {args.duration:g} s at up to {args.qps:g} req/s "
          f"to {args.url} ({model_id})")
    started = time.perf_counter()
    start = asyncio.run(replay.run(args.warmup))
    result = replay.result(start, args.policy, args.replicas, args.qps, time.perf_counter() - started)
    measured = {**result.summary(), **{k: result.extra[k] for k in ("num_errors", "send_lag_p99_ms", "idle_ttft_ms",
                                                                    "replicas_seen")}}
    if result.extra["num_errors"]:
        print(f"\n{result.extra['num_errors']} requests failed, e.g.: " + "; ".join(result.extra["errors"][:3]))
    return measured, result.extra["num_errors"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measured:
        args, measured = saved_measurement(args)
        workload, failed = make_workload(args), measured.get("num_errors", 0)
    else:
        workload = make_workload(args)
        measured, failed = replay_and_measure(args, workload)
    print("\nmeasured:\n" + format_table([measured], COLUMNS_REPLAY))
    print(f"TTFT on the idle server (HTTP, routing, one tiny step): {measured['idle_ttft_ms']:.1f} ms; "
          f"sends late by up to {measured['send_lag_p99_ms']:.1f} ms (p99); replicas: {measured['replicas_seen']}")
    output = {"args": vars(args), "measured": measured}
    if args.compare_sim:
        simulated = simulate_same(workload, args, measured["idle_ttft_ms"])
        rows = compare(simulated, measured, args.tolerance)
        print(f"\nsimulated ({SERVER_POLICIES[args.policy]}, {simulated['step_time_model']}; async scheduling "
              f"{args.async_scheduling}; server latency {simulated['server_latency_ms']:.1f} ms added to TTFT):\n"
              + format_table([simulated], COLUMNS))
        print("\n" + format_comparison(rows, dict(COMPARED)))
        verdict = "PASS" if all(r["check"] == "PASS" for r in rows if r["metric"] in CHECKED) else "FAIL"
        print(f"\nsimulator vs real, TTFT p50 and p90 within {args.tolerance:.0%}: {verdict}")
        output.update(simulated=simulated, comparison=rows, verdict=verdict)
    if args.out:
        Path(args.out).write_text(json.dumps(output, indent=2, default=str) + "\n")
    return 0 if not failed else 1
