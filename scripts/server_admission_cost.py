"""Server CPU per admitted streaming request, on CPU: the real FastAPI app and AsyncLLMEngine
over scripts/server_cpu_per_token.py's fake engine, and a burst of N streaming completions
(1 token each) sent at once over N warm keep-alive connections by a raw-socket client in
another process (light enough that the burst is the server's, not the client's).

Reports the server process's CPU per request over the burst (parse, validation, admission,
the one token's event, the response's end) and the time from the first request sent to the
last first token (the burst's TTFT). The median of ROUNDS bursts.

    python scripts/server_admission_cost.py [--requests 128] [--rounds 7] [--step-s 0.001] [--profile]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import selectors
import socket
import statistics
import sys
import threading
import time

import uvicorn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from server_cpu_per_token import FakeEngine  # noqa: E402

from roseray.engine.async_engine import AsyncLLMEngine  # noqa: E402
from roseray.server.api import create_app  # noqa: E402

PORT = 18125
MODEL = "random:gpt2"
END_OF_CHUNKED_BODY = b"\r\n0\r\n\r\n"


def _request_bytes() -> bytes:
    body = json.dumps({"model": MODEL, "prompt": [15496], "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _burst(sockets: list[socket.socket], request: bytes) -> tuple[float, float]:
    """Send one request on every socket, read every response to its end. Returns the
    seconds from the first send to the last first token, and to the last response's end."""
    selector = selectors.DefaultSelector()
    received = {s.fileno(): b"" for s in sockets}
    first_token: dict[int, float] = {}
    for s in sockets:
        selector.register(s, selectors.EVENT_READ)
    start = time.perf_counter()
    for s in sockets:
        s.sendall(request)
    pending = len(sockets)
    while pending:
        for key, _ in selector.select():
            fd = key.fd
            data = key.fileobj.recv(65536)
            if not data:
                raise RuntimeError("the server closed a connection")
            received[fd] += data
            if fd not in first_token and b"data: {" in received[fd]:
                first_token[fd] = time.perf_counter()
            if received[fd].endswith(END_OF_CHUNKED_BODY):
                assert received[fd].startswith(b"HTTP/1.1 200"), received[fd][:200]
                selector.unregister(key.fileobj)
                pending -= 1
    end = time.perf_counter()
    selector.close()
    return max(first_token.values()) - start, end - start


def _client(num_requests: int, rounds: int, conn) -> None:
    request = _request_bytes()
    sockets = [socket.create_connection(("127.0.0.1", PORT)) for _ in range(num_requests)]
    for s in sockets:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(2):  # warm the connections and the server's code paths
        _burst(sockets, request)
    results = []
    for _ in range(rounds):
        time.sleep(0.05)  # the server is idle between bursts
        conn.send("start")
        conn.recv()
        results.append(_burst(sockets, request))
        conn.send("end")
        conn.recv()
    for s in sockets:
        s.close()
    conn.send(results)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--step-s", type=float, default=0.001, help="the fake engine's step time")
    parser.add_argument("--profile", action="store_true", help="cProfile the server over the whole run")
    args = parser.parse_args()
    fake = FakeEngine(args.step_s)
    engine = AsyncLLMEngine(fake, max_waiting_requests=4096, max_running=4096)
    app = create_app(engine, fake.tokenizer, model_name=MODEL, max_model_len=2048)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=PORT, log_level="warning"))
    cpu_per_request: list[float] = []
    outcome: list = []

    def drive() -> None:
        while not server.started:
            time.sleep(0.05)
        ours, theirs = multiprocessing.Pipe()
        client = multiprocessing.get_context("spawn").Process(target=_client, args=(args.requests, args.rounds, theirs))
        client.start()
        for _ in range(args.rounds):
            assert ours.recv() == "start"
            before = _cpu_s()
            ours.send("go")
            assert ours.recv() == "end"
            cpu_per_request.append((_cpu_s() - before) / args.requests)
            ours.send("ok")
        outcome.extend(ours.recv())
        client.join()
        server.should_exit = True

    threading.Thread(target=drive, daemon=True).start()
    if args.profile:
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.runcall(server.run)
        pstats.Stats(profile).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", "30")))
    else:
        server.run()
    ttft = statistics.median(r[0] for r in outcome)
    whole = statistics.median(r[1] for r in outcome)
    print(f"{args.requests} streaming requests at once: server CPU {statistics.median(cpu_per_request) * 1e6:.0f} "
          f"us/request (min {min(cpu_per_request) * 1e6:.0f}), first send -> last first token {ttft * 1e3:.1f} ms, "
          f"-> last response end {whole * 1e3:.1f} ms (medians of {args.rounds} bursts)")


if __name__ == "__main__":
    main()
