"""The serving comparison: W-seed-like bursts (128 streams of prompt [15496], 128 greedy
tokens, ignore_eos) through HTTP and through the in-process AsyncLLMEngine, on the same
model, in one run: tok/s, TTFT, TPOT and ITL of each side, and HTTP / in-process.

    python -m roseray.bench serving [--model random:gpt2] [--api-processes 4] [--passes 4] [--out r.json]
    python -m roseray.bench serving --server-port 8000 --passes 16 --engine-args '{"num_kv_blocks": 16384}'

Without --server-port it starts `roseray serve --api-processes N` on --port, runs the HTTP
bursts, stops the server, then runs as many bursts on an in-process engine (each engine
sizes its KV cache from the accelerator memory it finds free, so they do not run side by side).

With --server-port it measures the server already listening there (for example the Ray
Serve app) in interleaved pairs: each HTTP burst next to a burst on an engine of this
process, the two taking turns at going first, so that a pair's two bursts meet the same
state of the machine. Both engines then share the accelerator: give this one a fixed
num_kv_blocks with --engine-args.

The first burst (or pair) warms up and is left out: reported are the medians of the
others and, with pairs, the median of the pairs' ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np

from roseray.bench.common import percentiles, write_result
from roseray.bench.serving_client import http_bursts
from roseray.bench.stream import SeedEngine, median_pass
from roseray.bench.workloads import SEED_MODEL
from roseray.config import EngineConfig

SERVER_START_TIMEOUT_S = 300.0


def http_goes_first(index: int) -> bool:
    """Whether pair `index` runs its HTTP burst first: the two sides take turns (HTTP first
    in pair 0), so that neither always runs right after the other."""
    return index % 2 == 0


def summarize(streams: list[tuple[float, list[float], int]], started_unix: float = 0.0,
              ended_unix: float = 0.0) -> dict:
    """One HTTP burst's figures from its streams (sent, event times, tokens): tok/s from the
    first send to the last event, and TTFT, TPOT (per stream) and ITL (every gap between
    events) percentiles in ms, as the in-process burst reports them."""
    started = min(sent for sent, _, _ in streams)
    wall = max(times[-1] for _, times, _ in streams) - started
    tokens = sum(count for _, _, count in streams)
    ttft = [times[0] - sent for sent, times, _ in streams]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for _, times, _ in streams if len(times) > 1]
    itl = np.concatenate([np.diff(times) for _, times, _ in streams])
    ms = lambda xs: {k: v * 1e3 for k, v in percentiles(xs).items()}  # noqa: E731
    return {"completion_tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall, "ttft_ms": ms(ttft),
            "tpot_ms": ms(tpot), "itl_ms": ms(itl), "started_unix": started_unix, "ended_unix": ended_unix}


def warm_median(runs: list[dict]) -> dict:
    """The median of all runs but the first (which warmed up), with every run kept."""
    warm = runs[1:] if len(runs) > 1 else runs
    return {**median_pass(warm), "warm_passes": len(warm), "all_passes": runs}


def figures(run: dict) -> str:
    return (f"{run['throughput_tok_s']:,.0f} tok/s, TTFT p50 {run['ttft_ms']['p50']:.1f} ms "
            f"p99 {run['ttft_ms']['p99']:.1f}, TPOT p50 {run['tpot_ms']['p50']:.2f} ms, "
            f"ITL p50 {run['itl_ms']['p50']:.2f} ms p99 {run['itl_ms']['p99']:.2f}")


def measure_http(port: int, model: str, n: int, max_tokens: int, processes: int, passes: int) -> dict:
    """`passes` HTTP bursts on the server at `port`, each printed; their warm median."""
    runs = []
    with contextlib.closing(http_bursts(port, model, n, max_tokens, processes, passes)) as bursts:
        for index, burst in enumerate(bursts):
            runs.append(summarize(*burst))
            print(f"pass {index + 1}/{passes}: HTTP {figures(runs[-1])}", flush=True)
    return warm_median(runs)


def measure_in_process(model: str, n: int, max_tokens: int, passes: int, engine_args: dict) -> dict:
    """`passes` bursts on an in-process engine with `engine_args`; their warm median."""
    with SeedEngine(model, n, engine_args, max_tokens=max_tokens) as seed:
        return {**seed.describe(), **warm_median([seed.burst() for _ in range(passes)])}


def measure_pairs(port: int, model: str, n: int, max_tokens: int, processes: int, passes: int,
                  engine_args: dict) -> dict:
    """`passes` pairs of bursts, one through the server at `port` and one on an in-process
    engine with `engine_args`, back to back (`http_goes_first` says in which order), each
    pair printed; the comparison of the warm medians with every warm pair's ratio."""
    with SeedEngine(model, n, engine_args, max_tokens=max_tokens) as seed:
        inproc: dict[int, dict] = {}

        def beside(index: int, http_done: bool) -> None:
            if http_goes_first(index) == http_done:
                inproc[index] = seed.burst()

        pairs = []
        with contextlib.closing(http_bursts(port, model, n, max_tokens, processes, passes, beside)) as bursts:
            for index, burst in enumerate(bursts):
                pairs.append((summarize(*burst), inproc.pop(index)))
                http, local = pairs[-1]
                print(f"pair {index + 1}/{passes}: HTTP {figures(http)}; in-process {figures(local)}; "
                      f"= {http['throughput_tok_s'] / local['throughput_tok_s']:.0%}", flush=True)
        described = seed.describe()
    result = compare({**warm_median([h for h, _ in pairs]), "server_port": port},
                     {**described, **warm_median([i for _, i in pairs])})
    warm = pairs[1:] if len(pairs) > 1 else pairs
    result["pair_ratios"] = [h["throughput_tok_s"] / i["throughput_tok_s"] for h, i in warm]
    result["median_pair_ratio"] = float(np.median(result["pair_ratios"]))
    print(f"median of the pairs' HTTP / in-process: {result['median_pair_ratio']:.0%}")
    return result


def compare(http: dict, inproc: dict) -> dict:
    """The two sides' figures, printed, with the throughput ratio."""
    ratio = http["throughput_tok_s"] / inproc["throughput_tok_s"]
    print(f"in-process: {figures(inproc)}\nHTTP:       {figures(http)}\nHTTP / in-process: {ratio:.0%}")
    return {"in_process": inproc, "http": http, "http_over_in_process": ratio}


def engine_flags(engine_args: dict) -> list[str]:
    """`roseray serve` flags that give its engine these EngineConfig fields."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    flags = []
    for name, value in engine_args.items():
        if name not in names:
            raise ValueError(f"--engine-args: {name!r} is not an EngineConfig field")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            flags += [flag, str(value)]
    return flags


@contextlib.contextmanager
def local_server(model: str, port: int, api_processes: int, engine_args: dict, log_path: str | None):
    """`roseray serve` on `port` until the block ends, ready when the block starts."""
    command = [sys.executable, "-m", "roseray.cli", "serve", "--model", model, "--port", str(port),
               "--api-processes", str(api_processes), *engine_flags(engine_args)]
    with open(log_path or os.devnull, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _ready(port):
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} (its log: --server-log)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready within {SERVER_START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)  # poll interval
        yield
    finally:
        server.terminate()
        server.wait(60)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.bench serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SEED_MODEL)
    parser.add_argument("--num-requests", type=int, default=128, help="streams per burst")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--passes", type=int, default=4, help="bursts (or pairs) per side; the first warms up")
    parser.add_argument("--client-processes", type=int, default=4, help="client processes sharing a burst's streams")
    parser.add_argument("--api-processes", type=int, default=1, help="`roseray serve --api-processes` of the server")
    parser.add_argument("--port", type=int, default=8011, help="the port of the server started here")
    parser.add_argument("--server-port", type=int, default=None,
                        help="measure the server already listening here, in pairs with an in-process engine")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help="EngineConfig fields as JSON, for the in-process engine and the server started here")
    parser.add_argument("--server-log", default=None, help="the started server's output goes here")
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args(argv)
    sizes = (args.model, args.num_requests, args.max_tokens, args.client_processes, args.passes)
    if args.server_port is not None:
        result = measure_pairs(args.server_port, *sizes, args.engine_args)
    else:
        server_args = {"max_num_seqs": args.num_requests, "enable_prefix_caching": False, **args.engine_args}
        with local_server(args.model, args.port, args.api_processes, server_args, args.server_log):
            http = {**measure_http(args.port, *sizes), "api_processes": args.api_processes}
        result = compare(http, measure_in_process(args.model, args.num_requests, args.max_tokens, args.passes,
                                                  args.engine_args))
    write_result(args.out, "serving", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
