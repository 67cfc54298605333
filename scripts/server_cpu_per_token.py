"""Server CPU per streamed token, on CPU: the real FastAPI app and AsyncLLMEngine over a fake
engine that makes one token per running request every STEP_S seconds (its own cost ~nil), 128
streaming clients from scripts/http_vs_inprocess.py. Measures the HTTP side alone.

`--steps-per-hand-off K`: each hand-off carries K steps' tokens per request (every K * STEP_S),
as when the engine process's client reads several step messages at once because the server
fell behind.

    python scripts/server_cpu_per_token.py [STEP_S=0.004] [--steps-per-hand-off K] [--profile]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time

import uvicorn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from http_vs_inprocess import _bursts  # noqa: E402

from roseray.engine.async_engine import AsyncLLMEngine  # noqa: E402
from roseray.engine.engine import EngineStats  # noqa: E402
from roseray.engine.request import RequestDelta, RequestSummary  # noqa: E402
from roseray.server.api import create_app  # noqa: E402
from roseray.tokenizer import ByteTokenizer  # noqa: E402

PORT = 18124


class FakeEngine:
    """LLMEngine's step contract; every running request gets the token 300 ("a") per step."""

    def __init__(self, step_s: float, steps_per_hand_off: int = 1) -> None:
        self.step_s = step_s
        self.steps_per_hand_off = steps_per_hand_off
        self.reqs: dict[str, list] = {}
        self.tokenizer = ByteTokenizer(50257, "fake")
        self.last_error = None

    def add_request(self, rid, prompt, params, arrival_time=None):
        self.reqs[rid] = [len(prompt), 0, params.max_tokens, arrival_time]

    def abort_request(self, rid):
        self.reqs.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def get_stats(self):
        return EngineStats(len(self.reqs), 0, 1000, 1000, 0.0, 0, 0, 0, 0, 0)

    def step(self):
        time.sleep(self.step_s * self.steps_per_hand_off)
        out = []
        for _ in range(self.steps_per_hand_off):
            for rid, r in list(self.reqs.items()):
                r[1] += 1
                done = r[1] >= r[2]
                out.append(RequestDelta(rid, [300], "a", done, "length" if done else None, None, r[0], r[1],
                                        RequestSummary(r[3]) if done else None))
                if done:
                    del self.reqs[rid]
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_s", nargs="?", type=float, default=0.004)
    parser.add_argument("--steps-per-hand-off", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    fake = FakeEngine(args.step_s, args.steps_per_hand_off)
    engine = AsyncLLMEngine(fake, max_waiting_requests=1024, max_running=256)
    app = create_app(engine, fake.tokenizer, model_name="random:gpt2", max_model_len=2048)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=PORT, log_level="warning"))

    def client():
        while not server.started:
            time.sleep(0.1)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        bursts = _bursts(PORT, "random:gpt2", 128, 256, 1, 1, None)  # one burst from one client process
        try:
            r = next(bursts)
        finally:
            bursts.close()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
        per_token = 1e6 / r["completion_tokens"]
        print(f"HTTP {r['throughput_tok_s']:,.0f} tok/s, server CPU {(user + system) * per_token:.1f} us/token "
              f"({user * per_token:.1f} user + {system * per_token:.1f} system; requests' set-up included), "
              f"ITL p50 {r['itl_ms']['p50']:.2f} ms")
        server.should_exit = True

    threading.Thread(target=client, daemon=True).start()
    if args.profile:
        import cProfile
        import pstats
        profile = cProfile.Profile()
        profile.runcall(server.run)
        pstats.Stats(profile).sort_stats("tottime").print_stats(28)
    else:
        server.run()


if __name__ == "__main__":
    main()
