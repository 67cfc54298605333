"""The HTTP side of the serving comparison: bursts of W-seed-like streaming completions
sent by client processes to a server, each stream timed event by event.

A burst is `n` streams that start together. They come from `processes` client processes
(one Python process has a ceiling of events per second, and would time itself rather than
the server), each holding one keep-alive connection per stream and sending each request as
prebuilt bytes (roseray.bench.stream_connection), so a burst reaches the server at once, as
an in-process engine gets its requests. Imports neither torch nor the engine: the client
processes start quickly.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator

from roseray.bench.stream_connection import StreamConnection, encode_post
from roseray.bench.workloads import SEED_PROMPT_TOKEN

BARRIER_TIMEOUT_S = 600.0  # a burst of a slow (CPU) server may take minutes


def seed_request(port: int, model: str, max_tokens: int, prompt_token: int = SEED_PROMPT_TOKEN) -> bytes:
    """One W-seed-like streaming completion (greedy, ignore_eos, usage at the end) as bytes."""
    return encode_post("127.0.0.1", port, "/v1/completions", {
        "model": model, "prompt": [prompt_token], "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})


async def one_stream(connection: StreamConnection, request: bytes) -> tuple[float, list[float], int]:
    """Send one request; (sent, the arrival time of each content event, completion tokens)."""
    sent = time.monotonic()
    answer = await connection.request(request)
    if answer.status != 200:
        raise RuntimeError(f"HTTP {answer.status}: {answer.body[:300]!r}")
    return sent, answer.event_times, answer.completion_tokens or 0


async def _client_streams(port: int, model: str, n: int, max_tokens: int, passes: int, barrier, results) -> None:
    connections = [await StreamConnection.open("127.0.0.1", port) for _ in range(n)]
    try:
        # warm the connections and the server's code paths before anything is timed
        await asyncio.gather(*[one_stream(c, seed_request(port, model, 2)) for c in connections])
        barrier.wait()
        request = seed_request(port, model, max_tokens)
        for _ in range(passes):
            barrier.wait()  # every client process and the parent are ready: the streams start together
            results.put(await asyncio.gather(*[one_stream(c, request) for c in connections]))
        barrier.wait()  # leave only when the parent says so, not during a burst measured beside this one
    finally:
        for connection in connections:
            connection.close()


def _client_process(port: int, model: str, n: int, max_tokens: int, passes: int, barrier, results) -> None:
    try:
        asyncio.run(_client_streams(port, model, n, max_tokens, passes, barrier, results))
    except BaseException:
        barrier.abort()  # the parent stops at once instead of waiting out its timeout
        results.put(None)
        raise


def http_bursts(port: int, model: str, n: int, max_tokens: int, processes: int, passes: int,
                beside: Callable[[int, bool], None] | None = None) -> Iterator[tuple[list, float, float]]:
    """Yields `passes` bursts of `n` streams on the server at `port`, each as (its streams as
    `one_stream` returns them, its start and end as unix times), from `processes` client
    processes that live through them all. `beside(index, done)` is called just before burst `index` (False) and just
    after it (True), so that what the caller runs there is next to the burst in time."""
    ctx = multiprocessing.get_context("spawn")
    processes = max(1, min(processes, n))
    barrier, queue = ctx.Barrier(processes + 1), ctx.Queue()
    shares = [n // processes + (i < n % processes) for i in range(processes)]
    workers = [ctx.Process(target=_client_process, args=(port, model, k, max_tokens, passes, barrier, queue))
               for k in shares]
    for worker in workers:
        worker.start()

    def wait_for_clients() -> None:
        try:
            barrier.wait(timeout=BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError("a client process failed (its traceback is above)") from None

    done = 0
    try:
        wait_for_clients()  # warmed up
        for index in range(passes):
            if beside is not None:
                beside(index, False)
            started = time.time()
            wait_for_clients()
            parts = [queue.get(timeout=BARRIER_TIMEOUT_S) for _ in workers]
            ended = time.time()
            if None in parts:
                raise RuntimeError("a client process failed (its traceback is above)")
            done += 1
            if beside is not None:
                beside(index, True)
            yield [stream for part in parts for stream in part], started, ended
    finally:
        if done == passes:
            wait_for_clients()  # the clients may leave now
        else:
            barrier.abort()
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.terminate()
