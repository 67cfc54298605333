"""Streaming decode through the async engine (W-seed): throughput, TTFT, TPOT, ITL.

All requests are submitted at once to AsyncLLMEngine; every delta is timestamped on
the asyncio side as a stream reader sees it.

    python -m roseray.bench stream --workload seed --out seed.json [--peer-hf] [--passes 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from roseray.bench.common import new_runner, percentiles, print_table, resolve_loop, write_result
from roseray.bench.workloads import SEED_MODEL, seed_workload
from roseray.config import EngineConfig
from roseray.runtime.async_engine import AsyncLLMEngine


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


async def _start(engine: AsyncLLMEngine) -> None:
    engine.start()  # on the running loop: an engine process is driven by it


async def _run(engine: AsyncLLMEngine, prompts, params, tag: str = "seed") -> dict:
    started = time.perf_counter()
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
    ms = lambda xs: {k: v * 1e3 for k, v in percentiles(xs).items()}  # noqa: E731
    return {"completion_tokens": total_tokens, "wall_s": wall, "throughput_tok_s": total_tokens / wall,
            "ttft_ms": ms(ttft), "tpot_ms": ms(tpot), "itl_ms": ms(itl),
            "chunks_with_several_tokens": multi_token_chunks}


def median_pass(passes: list[dict]) -> dict:
    """The pass of median throughput (the upper one of an even count), with every pass's
    throughput beside it: a W-seed burst is short, so one pass is noisy."""
    chosen = sorted(passes, key=lambda r: r["throughput_tok_s"])[len(passes) // 2]
    return {**chosen, "passes_tok_s": [r["throughput_tok_s"] for r in passes]}


class SeedEngine:
    """One engine for W-seed bursts, warmed on start: `burst()` runs the workload once and
    returns its figures. Kept open, it lets a caller put other measurements between its
    bursts (the serving comparison's pairs, roseray.bench.serving)."""

    def __init__(self, model: str, num_requests: int, engine_args: dict, loop: str = "auto",
                 max_tokens: int = 128) -> None:
        self.model, self.num_requests, self.engine_args, self.loop = model, num_requests, engine_args, loop
        self.prompts, self.params = seed_workload(num_requests, max_tokens)
        self.config = EngineConfig(model=model, max_num_seqs=num_requests, enable_prefix_caching=False,
                                   **engine_args)
        self.engine = AsyncLLMEngine.from_engine_config(self.config)
        # one event loop for every burst: the engine is started on it (an engine process is then
        # driven by that loop, as in a server) and stays bound to it
        self._runner = new_runner(loop)
        try:
            self._runner.run(_start(self.engine))
            self._runner.run(_run(self.engine, self.prompts[:8], self.params[:8]))  # warm-up
        except BaseException:
            self.close()
            raise
        self.bursts = 0

    def burst(self) -> dict:
        started = time.time()
        run = self._runner.run(_run(self.engine, self.prompts, self.params, tag=f"seed{self.bursts}"))
        self.bursts += 1
        return {**run, "started_unix": started, "ended_unix": time.time()}

    def describe(self) -> dict:
        return {"workload": "W-seed", "model": self.model, "num_requests": self.num_requests,
                "engine_args": self.engine_args, "engine_process": self.config.resolve_engine_process(),
                "event_loop": resolve_loop(self.loop)}

    def close(self) -> None:
        try:
            self._runner.run(self.engine.shutdown())
        finally:
            self._runner.close()

    def __enter__(self) -> SeedEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_seed(model: str, num_requests: int, engine_args: dict, loop: str = "auto", passes: int = 1,
             max_tokens: int = 128) -> dict:
    """W-seed on one engine: a warm-up, then `passes` bursts; the median pass is reported."""
    with SeedEngine(model, num_requests, engine_args, loop, max_tokens) as seed:
        return {**seed.describe(), **median_pass([seed.burst() for _ in range(passes)])}


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
    parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                        help="the event loop the streams are read on (auto: uvloop when installed, as uvicorn)")
    parser.add_argument("--passes", type=int, default=1,
                        help="measured bursts on the same engine; the median one is reported (all in passes_tok_s)")
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    result = run_seed(args.model, args.num_requests, {"enforce_eager": args.enforce_eager, "device": args.device,
                                                       "engine_process": args.engine_process},
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
