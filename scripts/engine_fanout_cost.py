"""What the engine process spends per step handing a step's outputs to its clients (the
API processes): `serve_engine` (one client) and `serve_clients` (several) driven by a stub
engine that returns one token for each of N requests per step at no cost, with each
client's pipe drained by a process of its own. Prints the loop's time per step and the
part of it counted in `output_seconds_total` (encoding and pipe writes). CPU only.

    python scripts/engine_fanout_cost.py [--requests 128] [--steps 3000] [--clients 1 4 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from multiprocessing.connection import Connection

from roseray.engine import engine_process
from roseray.engine.engine import EngineStats
from roseray.engine.request import RequestDelta, RequestSummary


class StubEngine:
    """The engine process's view of an engine: adds, aborts, steps that cost nothing."""

    def __init__(self, num_steps: int) -> None:
        self.requests: dict[str, int] = {}
        self.num_steps, self.steps = num_steps, 0
        self.last_error = None
        self.output_seconds_total = 0.0

    def add_request(self, request_id, token_ids, params, arrival_time=None) -> None:
        self.requests[request_id] = 0

    def abort_request(self, request_id) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestDelta]:
        self.steps += 1
        done = self.steps >= self.num_steps
        deltas = [RequestDelta(rid, [1234], " hello", done, "length" if done else None, None, 1, self.steps,
                               RequestSummary(0.0)) for rid in self.requests]
        if done:
            self.requests.clear()
        return deltas

    def get_stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 1000, 1000, 0.0, 0, 0, 0, 0, 0)


def _drain(fd: int) -> None:
    reader = Connection(fd, writable=False)
    try:
        while True:
            reader.recv_bytes()
    except EOFError:
        pass


def measure(num_clients: int, num_requests: int, num_steps: int) -> tuple[float, float]:
    """(loop us per step, output us per step) for `num_clients` clients sharing the requests."""
    engine = StubEngine(num_steps)
    child_ends, commands = [], []
    for _ in range(num_clients):
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        if os.fork() == 0:  # the client: reads every message, as an API process does
            os.close(out_w)
            os.close(cmd_w)
            _drain(out_r)
            os._exit(0)
        os.close(out_r)
        child_ends.append((Connection(cmd_r, writable=False), Connection(out_w, readable=False)))
        commands.append(Connection(cmd_w, readable=False))
    share = num_requests // num_clients
    for client in commands:
        client.send_bytes(engine_process._dumps(["add", [[str(j), [1], {}, 0.0] for j in range(share)]]))

    def stop_when_done() -> None:
        while engine.steps < num_steps:
            time.sleep(0.01)
        for client in commands:
            client.send_bytes(engine_process._dumps(["stop"]))

    threading.Thread(target=stop_when_done, daemon=True).start()
    started = time.perf_counter()
    if num_clients == 1:
        engine_process.serve_engine(engine, *child_ends[0])
    else:
        owners: dict = {}
        engine_process.serve_clients(engine, [engine_process.SharedEngineClient(i, c, o, owners)
                                              for i, (c, o) in enumerate(child_ends)])
    loop_us = (time.perf_counter() - started) / engine.steps * 1e6
    for reader, writer in child_ends:
        for connection in (reader, writer):
            try:
                connection.close()
            except OSError:
                pass
    for _ in range(num_clients):
        os.wait()
    return loop_us, engine.output_seconds_total / engine.steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128, help="deltas per step")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each client count, interleaved")
    args = parser.parse_args()
    for _ in range(args.repeats):
        for num_clients in args.clients:
            loop_us, output_us = measure(num_clients, args.requests, args.steps)
            print(f"{num_clients} client(s), {args.requests} deltas per step: loop {loop_us:.1f} us per step, "
                  f"of which sending the outputs {output_us:.1f} us")


if __name__ == "__main__":
    main()
