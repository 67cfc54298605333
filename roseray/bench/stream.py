"""Streaming decode through the async engine (W-seed): throughput, TTFT, TPOT, ITL.

All requests are submitted at once to AsyncLLMEngine; every delta is timestamped on
the asyncio side as a stream reader sees it.

    python -m roseray.bench stream --workload seed --out seed.json [--peer-hf] [--timeline]

`--timeline` also prints where the measured run's first milliseconds went, from its first
submission: when the adds were sent to the engine process (and how many per message),
and when the engine loop's first steps returned (with how many token deltas).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from roseray.bench.common import (
    engine_cpu_use,
    engine_time_split,
    new_runner,
    percentiles,
    print_table,
    resolve_loop,
    write_result,
)
from roseray.bench.workloads import SEED_MODEL, seed_workload
from roseray.config import EngineConfig
from roseray.runtime.async_engine import AsyncLLMEngine
from roseray.runtime.engine_client import EngineClient
from roseray.runtime.process_client import EngineProcessClient


async def _consume(engine: AsyncLLMEngine, request_id: str, prompt, params) -> tuple[float, list[tuple[float, int]]]:
    submitted = time.perf_counter()
    stream = await engine.add_request(request_id, prompt, params)
    arrivals = []  # (time, tokens in this chunk)
    async for deltas in stream:
        now = time.perf_counter()
        tokens = sum(len(d.new_token_ids) for d in deltas)
        if tokens:
            arrivals.append((now, tokens))
    return submitted, arrivals


class Timeline:
    """Times the async engine's calls into its engine client (wrapped on the instance, bench only)."""

    def __init__(self, client: EngineClient) -> None:
        self.started = 0.0
        self.flushes: list[tuple[float, int]] = []  # (time, adds in the command)
        self.steps: list[tuple[float, int]] = []  # (time a read of outputs returned, deltas with tokens)
        read_outputs, flush_commands = client.read_outputs, client.flush_commands

        def timed_read():
            deltas = read_outputs()
            if deltas or self.steps or self.flushes:
                self.steps.append((time.perf_counter(), sum(1 for d in deltas if d.new_token_ids)))
            return deltas

        def timed_flush():
            num_adds = flush_commands()
            if num_adds:
                self.flushes.append((time.perf_counter(), num_adds))
            return num_adds

        client.read_outputs, client.flush_commands = timed_read, timed_flush

    def report(self, first_tokens: list[float]) -> dict:
        ms = lambda t: round((t - self.started) * 1e3, 3)  # noqa: E731
        return {"adds_sent_ms": [(ms(t), n) for t, n in self.flushes[:8]],
                "steps_returned_ms": [(ms(t), n) for t, n in self.steps[:6]],
                "first_token_ms": {k: round(v, 3) for k, v in
                                   percentiles([(t - self.started) * 1e3 for t in first_tokens], (0, 50, 100)).items()}}


async def _start(engine: AsyncLLMEngine) -> None:
    engine.start()  # on the running loop, which drives it


async def _run(engine: AsyncLLMEngine, prompts, params, timeline: Timeline | None = None, tag: str = "seed") -> dict:
    started = time.perf_counter()
    if timeline is not None:
        timeline.started = started
    results = await asyncio.gather(*[_consume(engine, f"{tag}-{i}", p, s)
                                     for i, (p, s) in enumerate(zip(prompts, params))])
    ttft, tpot, itl = [], [], []
    total_tokens, last = 0, started
    multi_token_chunks = 0
    for submitted, arrivals in results:
        times = np.array([t for t, _ in arrivals])
        counts = [n for _, n in arrivals]
        total_tokens += sum(counts)
        multi_token_chunks += sum(1 for n in counts if n > 1)
        last = max(last, times[-1])
        ttft.append(times[0] - submitted)
        n = sum(counts)
        if n > 1:
            tpot.append((times[-1] - times[0]) / (n - 1))
        itl.extend(np.diff(times).tolist())
    wall = last - started
    extra = {"timeline": timeline.report([r[1][0][0] for r in results])} if timeline is not None else {}
    ms = lambda xs: {k: v * 1e3 for k, v in percentiles(xs).items()}  # noqa: E731
    return {"completion_tokens": total_tokens, "wall_s": wall, "throughput_tok_s": total_tokens / wall,
            "ttft_ms": ms(ttft), "tpot_ms": ms(tpot), "itl_ms": ms(itl),
            "chunks_with_several_tokens": multi_token_chunks, **extra}


def median_pass(passes: list[dict]) -> dict:
    """The pass of median throughput (the upper one of an even count), with every pass's
    throughput beside it: a W-seed burst lasts ~0.1 s on a GPU, so one pass is noisy."""
    chosen = sorted(passes, key=lambda r: r["throughput_tok_s"])[len(passes) // 2]
    return {**chosen, "passes_tok_s": [r["throughput_tok_s"] for r in passes]}


class SeedEngine:
    """One engine for W-seed bursts, warmed on start: `burst()` runs the workload once and
    returns its figures (with the engine process's CPU use). Kept open, it lets a caller put
    other measurements between its bursts (`scripts/http_vs_inprocess.py --interleave`)."""

    def __init__(self, model: str, num_requests: int, engine_args: dict, loop: str = "auto",
                 max_tokens: int = 128) -> None:
        self.model, self.num_requests, self.engine_args, self.loop = model, num_requests, engine_args, loop
        self.prompts, self.params = seed_workload(num_requests, max_tokens)
        self.config = EngineConfig(model=model, max_num_seqs=num_requests, enable_prefix_caching=False,
                                   **engine_args)
        self.engine = AsyncLLMEngine.from_engine_config(self.config)
        self._message_delays = [0.0, 0]  # the engine's step outputs: seconds read late, count
        self.engine.client.on_message_delay = self._on_message_delay
        # one event loop for every burst: the engine is started on it (and driven by that loop,
        # as in a server) and stays bound to it
        self._runner = new_runner(loop)
        try:
            self._runner.run(_start(self.engine))
            self._runner.run(_run(self.engine, self.prompts[:8], self.params[:8]))  # warm-up
        except BaseException:
            self.close()
            raise
        # the engine process, if any: its CPU use is recorded per burst
        client = self.engine.client
        self.engine_pid = client.pid if isinstance(client, EngineProcessClient) else None
        self.bursts = 0

    def burst(self, timeline: bool = False) -> dict:
        before, delays_before = self._engine_time(), list(self._message_delays)
        started = time.time()
        with engine_cpu_use(self.engine_pid) as cpu:
            run = self._runner.run(_run(self.engine, self.prompts, self.params,
                                        Timeline(self.engine.client) if timeline else None, tag=f"seed{self.bursts}"))
        self.bursts += 1
        seconds, count = (now - then for now, then in zip(self._message_delays, delays_before))
        if count:  # as the server's engine_message_delay_seconds, for the same engine without HTTP
            run["message_delay_mean_ms"] = seconds / count * 1e3
        return {**run, **cpu, **engine_time_split(before, self._engine_time()), "started_unix": started,
                "ended_unix": time.time()}

    def _on_message_delay(self, seconds: float) -> None:
        self._message_delays[0] += seconds
        self._message_delays[1] += 1

    def _engine_time(self) -> tuple[float, float, float]:
        s = self.engine.client.get_stats()
        return s.engine_steps_total, s.engine_step_seconds_total, s.engine_output_seconds_total

    def describe(self) -> dict:
        return {"workload": "W-seed", "model": self.model, "num_requests": self.num_requests,
                "engine_args": self.engine_args, "engine_process": self.config.resolve_engine_process(),
                "event_loop": resolve_loop(self.loop)}

    def close(self) -> None:
        self.engine.stop()
        self.engine.wait_stopped(10.0)
        self._runner.close()

    def __enter__(self) -> SeedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_seed(model: str, num_requests: int, engine_args: dict, timeline: bool = False, loop: str = "auto",
             passes: int = 1, max_tokens: int = 128) -> dict:
    """W-seed on one engine: a warm-up, then `passes` bursts; the median pass is reported."""
    with SeedEngine(model, num_requests, engine_args, loop, max_tokens) as seed:
        runs = [seed.burst(timeline and index == 0) for index in range(passes)]
        result = median_pass(runs)
        if timeline:  # the first pass's, whichever is the median
            result["timeline"] = runs[0]["timeline"]
        return {**seed.describe(), **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.bench stream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["seed"], default="seed")
    parser.add_argument("--model", default=SEED_MODEL)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine loop in its own process (default: on for CUDA), or in a thread of this one")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval in seconds: how long a thread may hold the GIL while the "
                             "engine thread waits for it (Python's default is 0.005)")
    parser.add_argument("--peer-hf", action="store_true",
                        help="also run transformers' continuous batching on the same workload (GPU)")
    parser.add_argument("--timeline", action="store_true",
                        help="also report when the adds reached the engine process and the first steps returned")
    parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                        help="the event loop the streams are read on (auto: uvloop when installed, as uvicorn)")
    parser.add_argument("--passes", type=int, default=1,
                        help="measured bursts on the same engine; the median one is reported (all in passes_tok_s)")
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    result = run_seed(args.model, args.num_requests, {"enforce_eager": args.enforce_eager, "device": args.device,
                                                       "engine_process": args.engine_process}, args.timeline,
                      args.loop, args.passes)
    result["switch_interval_s"] = sys.getswitchinterval()
    rows = [("engine loop", ("own process" if result["engine_process"] else "thread of this process")
             + f", streams read on {result['event_loop']}"),
            ("throughput", f"{result['throughput_tok_s']:,.0f} completion tok/s"),
            ("wall", f"{result['wall_s']:.3f} s")]
    if args.passes > 1:
        rows.append(("passes (tok/s)", ", ".join(f"{t:,.0f}" for t in result["passes_tok_s"])))
    for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
        v = result[metric]
        rows.append((metric.replace("_ms", ""), f"p50 {v['p50']:.3f}  p95 {v['p95']:.3f}  p99 {v['p99']:.3f} ms"))
    if "timeline" in result:
        t = result["timeline"]
        rows.append(("adds sent (ms, count)", str(t["adds_sent_ms"])))
        rows.append(("steps returned (ms, token deltas)", str(t["steps_returned_ms"])))
        rows.append(("first tokens (ms)", str(t["first_token_ms"])))
    if args.peer_hf:
        from roseray.bench.peer_hf import run_hf_seed  # the peer needs CUDA and transformers' CB

        peer = run_hf_seed(args.num_requests)
        result["peer"] = peer
        rows.append(("peer: HF generate_batch", f"{peer['throughput_tok_s']:,.0f} tok/s "
                     f"(roseray {result['throughput_tok_s'] / peer['throughput_tok_s']:.1f}x)"))
    print_table(f"W-seed on {args.model}", rows)
    write_result(args.out, "stream", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
