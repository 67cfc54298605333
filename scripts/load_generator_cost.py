"""What the load generator of scripts/http_vs_inprocess.py spends per streamed event: one
client process's CPU time per SSE event, reading 32 streams of 128 events each from a stub
server (an ASGI app under uvicorn, in a child process, that writes one event per stream
every 2 ms), and how long the process takes to put a burst's requests on the wire (first
request's send to the last's). Three ways are compared:

  aiohttp lines, asyncio   each stream read line by line on asyncio's loop (the script until c4f903b)
  aiohttp reads, <loop>    aiohttp, each read split into whole events (uvloop where installed; until
                           the stream connection)
  connection, <loop>       http_vs_inprocess._one: prebuilt requests on roseray.bench.stream_connection

Where the clients share the host with the server (the GPU host's measurement), their CPU is
taken from the server's cores. CPU only.

    python scripts/load_generator_cost.py [--streams 32] [--events 128] [--bursts 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from roseray.bench.common import resolve_loop, run_async

EVENT = (b'data: {"id":"cmpl-0","object":"text_completion","created":1,"model":"m",'
         b'"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n\n')
SERVER = """
import asyncio, sys, uvicorn
EVENT, GAP_S = {event!r}, 0.002

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    n = __import__("json").loads(body)["max_tokens"]
    await send({{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}})
    for _ in range(n):
        await send({{"type": "http.response.body", "body": EVENT, "more_body": True}})
        await asyncio.sleep(GAP_S)
    usage = b'data: {{"choices":[],"usage":{{"completion_tokens":%d}}}}\\n\\ndata: [DONE]\\n\\n' % n
    await send({{"type": "http.response.body", "body": usage}})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
"""


def _load_client():
    path = Path(__file__).resolve().parent / "http_vs_inprocess.py"
    spec = importlib.util.spec_from_file_location("http_vs_inprocess", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _aiohttp_one(session, url: str, model: str, max_tokens: int, *, whole_reads: bool):
    """One stream through aiohttp, read line by line (the script until c4f903b) or in whole
    reads split into events (from c4f903b until the stream connection)."""
    body = {"model": model, "prompt": [15496], "max_tokens": max_tokens, "stream": True}
    sent, times, tokens, tail = time.monotonic(), [], 0, b""
    async with session.post(url, json=body) as response:
        async for piece in (response.content.iter_any() if whole_reads else response.content):
            now = time.monotonic()
            if whole_reads:
                events = (tail + piece).split(b"\n\n")
                tail = events.pop()
            else:
                events = [piece]  # a line
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                if b'"choices":[]' in event:
                    tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                else:
                    times.append(now)
    return sent, times, tokens, ""


async def _aiohttp_bursts(read, port: int, streams: int, events: int, bursts: int):
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*[read(session, url, "m", 2) for _ in range(streams)])  # connections open
        start = time.process_time()
        runs = [await asyncio.gather(*[read(session, url, "m", events) for _ in range(streams)])
                for _ in range(bursts)]
        return time.process_time() - start, runs


async def _connection_bursts(client, port: int, streams: int, events: int, bursts: int):
    connections = [await client.StreamConnection.open("127.0.0.1", port) for _ in range(streams)]
    try:
        warm_up, request = client._request(port, "m", 2), client._request(port, "m", events)
        await asyncio.gather(*[client._one(connection, warm_up) for connection in connections])
        start = time.process_time()
        runs = [await asyncio.gather(*[client._one(connection, request) for connection in connections])
                for _ in range(bursts)]
        return time.process_time() - start, runs
    finally:
        for connection in connections:
            connection.close()


async def _cost(measure, port: int, streams: int, events: int, bursts: int) -> tuple[float, float]:
    """(CPU seconds per event, median ms from a burst's first send to its last) of one way of
    running the bursts (`_aiohttp_bursts` with a reader, or `_connection_bursts`)."""
    cpu_s, runs = await measure(port, streams, events, bursts)
    assert all(r[2] == events == len(r[1]) for results in runs for r in results), "events lost"
    counted = sum(len(r[1]) for results in runs for r in results)
    spreads = sorted(max(r[0] for r in results) - min(r[0] for r in results) for results in runs)
    return cpu_s / counted, spreads[len(spreads) // 2] * 1e3


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_listening(port: int, server: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the stub server exited with {server.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the stub server did not listen")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32, help="streams of one client process (128 / 4 processes)")
    parser.add_argument("--events", type=int, default=128, help="events per stream (W-seed: 128 tokens)")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER.format(event=EVENT), str(port)])
    try:
        _wait_listening(port, server)
        loop = resolve_loop("auto")
        aiohttp_way = lambda whole_reads: functools.partial(  # noqa: E731
            _aiohttp_bursts, functools.partial(_aiohttp_one, whole_reads=whole_reads))
        ways = [("aiohttp lines, asyncio", aiohttp_way(False), "asyncio"),
                (f"aiohttp reads, {loop}", aiohttp_way(True), "auto"),
                (f"connection, {loop}", functools.partial(_connection_bursts, _load_client()), "auto")]
        for _ in range(args.repeats):
            for name, measure, loop in ways:
                seconds, spread_ms = run_async(_cost(measure, port, args.streams, args.events, args.bursts), loop)
                print(f"{name:24s} {seconds * 1e6:6.1f} us of CPU per event, sends spread over {spread_ms:.2f} ms "
                      f"({args.bursts} bursts of {args.streams} x {args.events})")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
