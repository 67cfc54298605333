"""Issue 4's measurement: W-seed-like requests (128 streams, prompt [15496], 128 greedy
tokens, ignore_eos) through the in-process AsyncLLMEngine and through HTTP (the same
FastAPI app served by `roseray serve`, one engine, `--api-processes` API processes in
front of it, `--client-processes` client processes), in one run.

    python scripts/http_vs_inprocess.py [--model random:gpt2] [--api-processes 2] [--passes 4] [--out result.json]
    bash scripts/ray_vs_inprocess.sh        # the same through the Ray Serve app (--server-port --interleave)

With --server-port and --interleave the two halves take turns, burst for burst, in one run:
pairs of an HTTP burst and an in-process burst (which goes first alternates), the latter on
an engine of this process that stays up beside the server's (idle meanwhile). A pair's two
bursts run back to back, with the server's counters read around both: the machine's speed
drifts within seconds, and two identical engines come out 3% apart at the median back to
back against 22% three seconds apart (scripts/pair_noise.py, BENCHMARKS.md). Both engines
need a fixed KV size (--engine-args '{"num_kv_blocks": N}'), as the second one cannot size
itself from the GPU memory left. --engine-cpu K puts both engine children on vCPU K.

The clients send each request as prebuilt bytes on a keep-alive connection of their own
(roseray.bench.stream_connection): a process's 32 requests leave within ~0.4 ms on the dev
box, where aiohttp took ~1.8 ms (scripts/load_generator_cost.py), so a burst starts at once
on the HTTP side, as it does in-process. Needs the serving dependencies (FastAPI, uvicorn:
the GPU host's bundle).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

import numpy as np

from roseray.bench.common import (
    engine_cpu_use,
    engine_time_from_metrics,
    engine_time_split,
    histogram_totals,
    percentiles,
    run_async,
    server_time_split,
)
from roseray.bench.cpu_placement import keep_off, pin_process, restore
from roseray.bench.host_cpu import HostCPU, host_cpu_use, median_host_cpu
from roseray.bench.stream import SeedEngine, median_pass, run_seed
from roseray.bench.stream_connection import StreamConnection, encode_post
from roseray.openai_api import request_trace
from roseray.openai_api.metrics_share import PUBLISH_INTERVAL_S

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pool_pairs import http_goes_first, pair_gap_s  # noqa: E402  (the pairs' order, defined once)


def _request(port: int, model: str, max_tokens: int, request_id: str | None = None) -> bytes:
    """One W-seed-like streaming completion, encoded once and sent as these bytes (with an
    x-request-id of ours when given: the request trace follows it through the server)."""
    return encode_post("127.0.0.1", port, "/v1/completions", {
        "model": model, "prompt": [15496], "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}},
        None if request_id is None else {"x-request-id": request_id})


async def _one(connection: StreamConnection, request: bytes) -> tuple[float, list[float], int, str]:
    """One stream: (sent, each content event's arrival, completion tokens, x-roseray-replica).
    Each event is stamped with the time of the read that completed it."""
    sent = time.monotonic()
    answer = await connection.request(request)
    assert answer.status == 200, f"HTTP {answer.status}: {answer.body[:300]!r}"
    return sent, answer.event_times, answer.completion_tokens or 0, answer.headers.get("x-roseray-replica", "")


async def _client_streams(port: int, model: str, n: int, max_tokens: int, passes: int, barrier, results) -> None:
    # one keep-alive connection per stream, as long-lived clients hold; the first requests warm
    # them and the server's code paths
    connections = [await StreamConnection.open("127.0.0.1", port) for _ in range(n)]
    try:
        warm_up = _request(port, model, 4)
        await asyncio.gather(*[_one(connection, warm_up) for connection in connections])
        barrier.wait()  # warmed: the parent reads the server's counters after this
        requests = [_request(port, model, max_tokens)] * n
        trace = request_trace.from_env("client")  # ROSERAY_REQUEST_TRACE_DIR: each request named, its times kept
        for burst in range(passes):
            if trace is not None:  # ids "c<pid>-<burst>-<stream>": scripts/burst_timeline.py groups them by burst
                ids = [f"c{os.getpid()}-{burst}-{i}" for i in range(n)]
                requests = [_request(port, model, max_tokens, request_id) for request_id in ids]
            barrier.wait()  # every client process and the parent are ready: all streams start together
            answers = await asyncio.gather(*[_one(connection, r) for connection, r in zip(connections, requests)])
            if trace is not None:
                for request_id, (sent, event_times, _, _) in zip(ids, answers):
                    trace.record(request_id, "client_sent", sent)
                    trace.record(request_id, "client_first_token", event_times[0])
            results.put(answers)
        barrier.wait()  # exit only when the parent says: an exit's CPU would land in a burst beside it
    finally:
        for connection in connections:
            connection.close()


def _client_process(port, model, n, max_tokens, passes, barrier, results) -> None:
    try:
        run_async(_client_streams(port, model, n, max_tokens, passes, barrier, results))  # on uvloop when installed
    except BaseException:  # the parent stops at once instead of waiting out its timeouts
        barrier.abort()
        results.put(None)
        raise


def _summary(results: list, processes: int) -> dict:
    started = min(r[0] for r in results)
    last = max(r[1][-1] for r in results)
    total = sum(r[2] for r in results)
    itl = np.concatenate([np.diff(r[1]) for r in results])
    tpot = [(r[1][-1] - r[1][0]) / (len(r[1]) - 1) for r in results if len(r[1]) > 1]
    ttft = [r[1][0] - r[0] for r in results]
    ms = lambda xs: {k: v * 1e3 for k, v in percentiles(xs).items()}  # noqa: E731
    return {"completion_tokens": total, "wall_s": last - started, "throughput_tok_s": total / (last - started),
            "ttft_ms": ms(ttft), "ttft_mean_ms": float(np.mean(ttft)) * 1e3, "tpot_ms": ms(tpot),
            # from the first request of the burst on the wire to the last (the client's own spread)
            "send_spread_ms": (max(r[0] for r in results) - started) * 1e3, "itl_ms": ms(itl), "client_processes": processes,
            # events that reached the client together (the server wrote several steps' tokens at once)
            "gaps_under_50us_fraction": float(np.mean(itl < 50e-6)),
            # the gaps between reads that brought tokens (events closer than 50 us count as one chunk)
            "chunk_gap_ms": ms(itl[itl >= 50e-6]), "events_per_chunk": float(len(itl) / max(1, np.sum(itl >= 50e-6))),
            # streams per API process (x-roseray-replica): how the connections spread
            "served_by": dict(collections.Counter(r[3] for r in results).most_common())}


def _bursts(port: int, model: str, n: int, max_tokens: int, processes: int, passes: int, engine_pid: int | None,
            host: HostCPU | None = None, beside: Callable[[int, bool], None] | None = None):
    """Yields `passes` bursts of `n` streams, one after another, from `processes` client
    processes that live through them all and start each burst together (one Python client
    process has a ceiling of events per second and would time itself, not the server).
    `host`: also every process's CPU use over each burst, by role (host_cpu_ms).
    `beside(index, burst_done)`: called just before burst `index` (False) and just after it
    (True), with the server's counters read before the first call and after the second, so
    that whatever the caller runs there is next to the burst in time."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(processes + 1), ctx.Queue()
    shares = [n // processes + (i < n % processes) for i in range(processes)]
    workers = [ctx.Process(target=_client_process, args=(port, model, k, max_tokens, passes, barrier, queue))
               for k in shares]
    for worker in workers:
        worker.start()
    def wait_for_clients() -> None:
        try:
            barrier.wait(timeout=600)
        except threading.BrokenBarrierError:
            raise RuntimeError("a client process failed (its traceback is above)") from None

    done = 0
    try:
        wait_for_clients()  # their warm-up requests are done
        time.sleep(PUBLISH_INTERVAL_S + 0.2)  # and in every API process's shared metrics
        for index in range(passes):
            page = _metrics_page(port)
            if beside is not None:
                beside(index, False)
            with host_cpu_use(host) as host_cpu, engine_cpu_use(engine_pid) as cpu:
                started = time.time()
                wait_for_clients()
                parts = [queue.get(timeout=600) for _ in workers]
                ended = time.time()
            if None in parts:
                raise RuntimeError("a client process failed (its traceback is above)")
            done += 1  # the clients are on their way to the next barrier (or the last one)
            if beside is not None:
                beside(index, True)
            engine_after = engine_time_over_http(port)
            yield {**_summary([r for part in parts for r in part], processes), **cpu,
                   **engine_time_split(engine_time_from_metrics(page), engine_after),
                   **server_time_split(histogram_totals(page), _settled_request_times(port, page, n)),
                   **host_cpu, "started_unix": started, "ended_unix": ended}
    finally:
        if done == passes:
            wait_for_clients()  # they may exit now, not in a burst measured beside them
        else:
            barrier.abort()
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.terminate()


def _metrics_page(port: int) -> str:
    """The server's /metrics page ("" when it cannot be read)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()
    except OSError:
        return ""


def engine_time_over_http(port: int) -> tuple[float, float, float] | None:
    """The server's engine time counters from its /metrics (None when it has none)."""
    return engine_time_from_metrics(_metrics_page(port))


def _settled_request_times(port: int, before_page: str, n: int, timeout_s: float = 3.0) -> dict:
    """histogram_totals of the server once its time-to-first-token histogram counts the `n`
    requests of a burst after `before_page` (API processes share their request metrics as
    snapshots up to ~1 s old: metrics_share.py), or whatever it counts after `timeout_s`."""
    name = "roseray:time_to_first_token_seconds"
    start = histogram_totals(before_page).get(name, (0.0, 0.0))[1]
    deadline = time.monotonic() + timeout_s
    while True:
        totals = histogram_totals(_metrics_page(port))
        if totals.get(name, (0.0, 0.0))[1] >= start + n or time.monotonic() > deadline:
            return totals
        time.sleep(0.1)


def engine_process_pid() -> int | None:
    """The pid of the one `roseray.runtime.engine_process` on this machine (the server's), or None."""
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"roseray.runtime.engine_process" in f.read():
                    found.append(int(name))
        except (OSError, ValueError):
            continue
    return found[0] if len(found) == 1 else None


def measure_passes(port: int, model: str, n: int, max_tokens: int, processes: int, passes: int,
                   engine_pid: int | None) -> dict:
    """`passes` bursts on the server at `port`, each printed; the median of all but the first
    (which warms the server for the burst's arrival pattern), with every pass kept."""
    runs = []
    for index, http in enumerate(_bursts(port, model, n, max_tokens, processes, passes, engine_pid)):
        runs.append(http)
        print(f"pass {index + 1}/{passes}: HTTP {http['throughput_tok_s']:,.0f} tok/s, TTFT p50 "
              f"{http['ttft_ms']['p50']:.1f} ms (p95 {http['ttft_ms']['p95']:.1f}), chunk gap p50 "
              f"{http['chunk_gap_ms']['p50']:.2f} ms, {http['events_per_chunk']:.2f} events per chunk; "
              f"streams per process {sorted(http['served_by'].values(), reverse=True)}{_engine_text(http)}")
    return _warm_median(runs)


def _warm_median(runs: list[dict]) -> dict:
    """The median of all but the first run (which warmed up), with every run kept: a W-seed
    burst lasts ~0.1 s, so one is noisy."""
    warm = runs[1:] if len(runs) > 1 else runs
    return {**median_pass(warm), "warm_passes": len(warm), "all_passes": runs}


def _print_pair(index: int, passes: int, http: dict, inproc: dict) -> None:
    print(f"pair {index + 1}/{passes}: HTTP {http['throughput_tok_s']:,.0f} tok/s (TTFT p50 "
          f"{http['ttft_ms']['p50']:.1f} ms, chunk gap p50 {http['chunk_gap_ms']['p50']:.2f} ms), "
          f"in-process {inproc['throughput_tok_s']:,.0f} tok/s (TTFT p50 {inproc['ttft_ms']['p50']:.1f} ms, "
          f"TPOT p50 {inproc['tpot_ms']['p50']:.2f} ms) = "
          f"{http['throughput_tok_s'] / inproc['throughput_tok_s']:.0%}; HTTP{_engine_text(http) or ': -'}; "
          f"in-process{_engine_text(inproc) or ': -'}")


@contextlib.contextmanager
def engines_on_one_cpu(engine_pids: list[int], cpu: int, isolate: bool):
    """Both engine children on vCPU `cpu` (they never step at once: the bursts take turns),
    so that a pair compares the paths, not where the scheduler put each engine; `isolate`:
    every other thread of the machine is moved off that vCPU too. Yields what it did, and
    puts every affinity back on exit."""
    changed = [tid for pid in engine_pids for tid in pin_process(pid, {cpu})]
    if not changed:
        raise RuntimeError(f"could not pin the engine children {engine_pids} (not ours to move: run as their user "
                           f"or root)")
    placement = {"engine_cpu": cpu, "engine_threads_pinned": len(changed)}
    moved = keep_off({cpu}, set(engine_pids)) if isolate else []
    if isolate:
        placement["threads_kept_off_engine_cpu"] = len(moved)
    print(f"engine children {engine_pids} pinned to CPU {cpu} ({len(changed)} threads)"
          + (f"; {len(moved)} other threads moved off it" if isolate else ""))
    try:
        yield placement
    finally:
        restore(moved + changed)


def measure_interleaved(port: int, model: str, n: int, max_tokens: int, processes: int, passes: int,
                        engine_pid: int | None, engine_args: dict, engine_cpu: int | None = None,
                        isolate_engine_cpu: bool = False) -> dict:
    """`passes` pairs of bursts: one through the server at `port` and one on an in-process
    engine with `engine_args`, taking turns at going first (neither side always runs right
    after the other), each pair printed; the first pair warms both. Returns the comparison
    of the warm medians, with every pair's ratio and their median. `engine_cpu`: both
    engine children run on that vCPU (`engines_on_one_cpu`)."""
    with SeedEngine(model, n, engine_args, max_tokens=max_tokens) as seed:  # up first: its start-up takes the GPU for a while
        pairs = []
        placed = contextlib.nullcontext({})
        if engine_cpu is not None:
            if not (engine_pid and seed.engine_pid):
                raise RuntimeError("--engine-cpu needs both engines in processes of their own (engine_process)")
            placed = engines_on_one_cpu([engine_pid, seed.engine_pid], engine_cpu, isolate_engine_cpu)
        host = HostCPU({pid: role for pid, role in ((engine_pid, "engine child (replica)"),
                                                    (seed.engine_pid, "engine child (in-process)")) if pid})
        inproc_runs: dict[int, dict] = {}

        def inproc_burst(index: int, http_done: bool) -> None:
            """The pair's in-process burst, right before its HTTP burst (odd pairs) or right after
            it (even pairs): on this host the engines' speed drifts within seconds, so a pair's
            two bursts are kept next to each other (scripts/pair_noise.py: two identical engines
            differ by a median 3% back to back and 22% three seconds apart)."""
            if http_goes_first(index) == http_done:
                with host_cpu_use(host) as host_cpu:
                    run = seed.burst()
                inproc_runs[index] = {**run, **host_cpu}

        with placed as placement:
            bursts = _bursts(port, model, n, max_tokens, processes, passes, engine_pid, host, inproc_burst)
            try:
                for index, http in enumerate(bursts):
                    inproc = inproc_runs.pop(index)
                    pairs.append((http, inproc))
                    _print_pair(index, passes, http, inproc)
            finally:
                bursts.close()  # the client processes end
        described = seed.describe()
    http = {**_warm_median([h for h, _ in pairs]), "server_port": port}
    inproc = {**described, **_warm_median([i for _, i in pairs])}
    result = compare(http, inproc, f"server on port {port}, interleaved")
    warm = pairs[1:] if len(pairs) > 1 else pairs
    ratios = [h["throughput_tok_s"] / i["throughput_tok_s"] for h, i in warm]
    result["pair_ratios"] = ratios
    result["median_pair_ratio"] = float(np.median(ratios))
    gaps = [pair_gap_s(index, h, i) for index, (h, i) in enumerate(warm, start=1)]
    result["pair_gap_ms_median"] = float(np.median(gaps)) * 1e3
    result.update(placement)
    print(f"pairs: HTTP / in-process {', '.join(f'{r:.0%}' for r in ratios)}; median {np.median(ratios):.0%}; "
          f"a pair's two bursts {result['pair_gap_ms_median']:.0f} ms apart (median)")
    for side, key, runs in (("HTTP", "http", [h for h, _ in warm]), ("in-process", "in_process", [i for _, i in warm])):
        roles = median_host_cpu(runs)
        if roles:
            result[f"{key}_host_cpu_ms_median"] = roles
            print(f"host CPU per {side} burst (median ms): " + ", ".join(f"{role} {ms:.0f}" for role, ms in roles.items()))
    return result


def run_http(model: str, n: int, max_tokens: int, port: int, processes: int, api_processes: int = 1,
             passes: int = 1) -> dict:
    server = subprocess.Popen([sys.executable, "-m", "roseray.cli", "serve", "--model", model, "--port", str(port),
                               "--max-num-seqs", str(n), "--no-enable-prefix-caching",
                               "--api-processes", str(api_processes)],
                              stdout=subprocess.DEVNULL, stderr=open(os.environ.get("SERVER_LOG", "/dev/null"), "w"))
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} (see SERVER_LOG)")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2)
                break
            except Exception:
                time.sleep(1)
        else:
            raise RuntimeError("the server did not become ready")
        return {**measure_passes(port, model, n, max_tokens, processes, passes, engine_process_pid()),
                "api_processes": api_processes}
    finally:
        server.terminate()
        server.wait(60)


def _engine_text(run: dict) -> str:
    text = ""
    if "server_ttft_mean_ms" in run:  # where a request's time to first token went, on average
        text += (f"; TTFT mean {run['ttft_mean_ms']:.1f} ms = {run['ttft_mean_ms'] - run['server_ttft_mean_ms']:.1f} "
                 f"before the API process + {run['server_ttft_mean_ms']:.1f} in it (queued "
                 f"{run.get('server_queue_mean_ms', float('nan')):.1f}); sends spread over "
                 f"{run['send_spread_ms']:.1f} ms")
    if "message_delay_mean_ms" in run:  # a GIL-starved or lagging engine-client thread reads late
        text += f"; step messages read {run['message_delay_mean_ms']:.2f} ms after sending"
    if "engine_step_us" in run:
        text += (f"; engine step {run['engine_step_us']:.0f} us + output {run['engine_output_us']:.0f} us "
                 f"({run['engine_steps']} steps)")
    if "engine_process_cpu_s" in run:
        text += f"; engine process {run['engine_process_cpu_s'] * 1e3:.0f} ms on CPU"
        if run.get("engine_process_runqueue_wait_s"):  # zero where the kernel keeps no schedstats
            text += f", {run['engine_process_runqueue_wait_s'] * 1e3:.1f} ms waiting for one"
        if "engine_process_involuntary_switches" in run:
            text += f", taken off its CPU {run['engine_process_involuntary_switches']} times"
        if "engine_process_migrations" in run:
            text += f", moved {run['engine_process_migrations']} times"
        if "engine_process_last_cpu" in run:
            text += f", last on CPU {run['engine_process_last_cpu']}"
    return text


def compare(http: dict, inproc: dict, label: str) -> dict:
    """The HTTP run against the in-process one: the issue's two ratios, printed and returned."""
    ratio = http["throughput_tok_s"] / inproc["throughput_tok_s"]
    itl_over_step = http["itl_ms"]["p50"] / inproc["tpot_ms"]["p50"]
    chunk_gap_over_step = http["chunk_gap_ms"]["p50"] / inproc["tpot_ms"]["p50"]
    short = lambda t: f"{t / 1e3:.0f}k" if t >= 1e4 else f"{t:.0f}"  # noqa: E731
    spread = lambda r: (f" [median of {', '.join(short(t) for t in r['passes_tok_s'])}]"  # noqa: E731
                        if len(r.get("passes_tok_s", ())) > 1 else "")
    print(f"in-process {inproc['throughput_tok_s']:,.0f} tok/s{spread(inproc)} (TPOT p50 {inproc['tpot_ms']['p50']:.2f} ms); "
          f"HTTP {http['throughput_tok_s']:,.0f} tok/s{spread(http)} = {ratio:.0%}; "
          f"HTTP ITL p50 {http['itl_ms']['p50']:.2f} ms "
          f"= {itl_over_step:.2f}x the engine step; HTTP TTFT p50 {http['ttft_ms']['p50']:.1f} ms, "
          f"ITL p99 {http['itl_ms']['p99']:.2f} ms; HTTP TPOT p50 {http['tpot_ms']['p50']:.2f} ms; "
          f"{http['gaps_under_50us_fraction']:.0%} of gaps < 50 us (events that arrived together); "
          f"chunk gap p50 {http['chunk_gap_ms']['p50']:.2f} ms = {chunk_gap_over_step:.2f}x the step, "
          f"{http['events_per_chunk']:.2f} events per chunk; {label}; in-process{_engine_text(inproc) or ': -'}; "
          f"HTTP{_engine_text(http) or ': -'}")
    return {"in_process": inproc, "http": http, "http_over_in_process": ratio,
            "http_itl_p50_over_engine_step": itl_over_step, "http_chunk_gap_p50_over_engine_step": chunk_gap_over_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--client-processes", type=int, default=4,
                        help="client processes sharing the streams (each sends its share of a burst within "
                             "~0.4 ms of 32 requests on the dev box and reads ~40,000 events per second on the GPU "
                             "host; more processes compete with the server for the host's cores: see BENCHMARKS.md)")
    parser.add_argument("--api-processes", type=int, default=1, help="`roseray serve --api-processes`")
    parser.add_argument("--server-port", type=int, default=None,
                        help="measure the server already listening here (e.g. the Ray Serve app) and write the "
                             "HTTP half only; compare later with --against-http")
    parser.add_argument("--passes", type=int, default=1,
                        help="HTTP bursts one after another on one server: the median of all but the first (which "
                             "warms the server for the burst's arrival pattern) is compared with the median of as "
                             "many in-process bursts on one engine (with --against-http: as the JSON's HTTP run had)")
    parser.add_argument("--engine-pid", type=int, default=None,
                        help="with --server-port: the server's engine process, whose CPU time and run-queue wait "
                             "each pass records (from /proc/PID/schedstat; default: the one running here, if one)")
    parser.add_argument("--interleave", action="store_true",
                        help="with --server-port: pair each HTTP burst with an in-process burst (which goes first "
                             "alternates), on an engine of this process beside the server's (give both a fixed "
                             "num_kv_blocks), and compare")
    parser.add_argument("--engine-cpu", type=int, default=None,
                        help="with --interleave: pin both engine children (the server's and the in-process one) to "
                             "this vCPU, so a pair does not also compare where the scheduler put each (Linux)")
    parser.add_argument("--isolate-engine-cpu", action="store_true",
                        help="with --engine-cpu: also move every other thread of the machine off that vCPU "
                             "(needs root for other users' processes)")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help="EngineConfig fields as JSON for the in-process engine (as the server's)")
    parser.add_argument("--against-http", default=None,
                        help="a --server-port run's JSON: run the in-process half now and compare with it")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.interleave and args.server_port is None:
        parser.error("--interleave measures a server already listening: give --server-port")
    if args.engine_cpu is not None and not args.interleave:
        parser.error("--engine-cpu places the two engines of --interleave")
    if args.interleave:
        result = measure_interleaved(args.server_port, args.model, args.num_requests, args.max_tokens,
                                     args.client_processes, args.passes, args.engine_pid or engine_process_pid(),
                                     args.engine_args, args.engine_cpu, args.isolate_engine_cpu)
    elif args.server_port is not None:
        http = measure_passes(args.server_port, args.model, args.num_requests, args.max_tokens,
                              args.client_processes, args.passes, args.engine_pid or engine_process_pid())
        result = {"http": {**http, "server_port": args.server_port}}
    elif args.against_http is not None:
        with open(args.against_http) as f:
            http = json.load(f)["http"]
        inproc = run_seed(args.model, args.num_requests, args.engine_args, passes=http["warm_passes"],
                          max_tokens=args.max_tokens)
        result = compare(http, inproc, f"server on port {http['server_port']}")
    else:
        # HTTP first: the server process must find the GPU free (each engine sizes its KV
        # cache from the memory left), and the in-process engine runs after it has exited.
        http = run_http(args.model, args.num_requests, args.max_tokens, args.port, args.client_processes,
                        args.api_processes, args.passes)
        inproc = run_seed(args.model, args.num_requests, args.engine_args, passes=http["warm_passes"],
                          max_tokens=args.max_tokens)
        result = compare(http, inproc, f"{args.api_processes} API process(es)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
