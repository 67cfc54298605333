"""Streaming decode through the async engine (W-seed): throughput, TTFT, TPOT, ITL.

All requests are submitted at once to AsyncLLMEngine; every delta is timestamped on
the asyncio side as a stream reader sees it.

    python -m roseray.bench stream --workload seed --out seed.json [--peer-hf]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np

from roseray.bench.common import percentiles, print_table, write_result
from roseray.bench.workloads import SEED_MODEL, seed_workload
from roseray.config import EngineConfig
from roseray.engine.async_engine import AsyncLLMEngine


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


async def _run(engine: AsyncLLMEngine, prompts, params) -> dict:
    started = time.perf_counter()
    results = await asyncio.gather(*[_consume(engine, f"seed-{i}", p, s)
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
            "ttft_ms": ms(ttft), "tpot_ms": ms(tpot), "itl_ms": ms(itl), "chunks_with_several_tokens": multi_token_chunks}


def run_seed(model: str, num_requests: int, engine_args: dict) -> dict:
    prompts, params = seed_workload(num_requests)
    config = EngineConfig(model=model, max_num_seqs=num_requests, enable_prefix_caching=False, **engine_args)
    engine = AsyncLLMEngine.from_engine_config(config)
    engine.start()
    try:
        asyncio.run(_run(engine, prompts[:8], params[:8]))  # warm-up
        engine._loop = None  # a new event loop for the measured run
        result = asyncio.run(_run(engine, prompts, params))
    finally:
        engine.stop()
        if engine._thread is not None:
            engine._thread.join(10.0)
    return {"workload": "W-seed", "model": model, "num_requests": num_requests, "engine_args": engine_args,
            "engine_process": config.resolve_engine_process(), **result}


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
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    result = run_seed(args.model, args.num_requests, {"enforce_eager": args.enforce_eager, "device": args.device,
                                                       "engine_process": args.engine_process})
    result["switch_interval_s"] = sys.getswitchinterval()
    rows = [("engine loop", "own process" if result["engine_process"] else "thread of this process"),
            ("throughput", f"{result['throughput_tok_s']:,.0f} completion tok/s"),
            ("wall", f"{result['wall_s']:.3f} s")]
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
