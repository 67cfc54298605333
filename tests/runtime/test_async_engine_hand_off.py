"""AsyncLLMEngine's hand-offs over a fake engine (no model) on its own thread: steps that
queue up while the event loop is busy are taken by one hand-off, an attached stream gets
every delta in order and one flush per hand-off, never one per step."""

from __future__ import annotations

import asyncio
import time

from roseray.config import EngineConfig
from roseray.engine.limits import RequestLimits
from roseray.engine.outputs import EngineStats, RequestDelta, RequestSummary
from roseray.runtime.async_engine import AsyncLLMEngine
from roseray.runtime.in_process_client import InProcessEngineClient
from roseray.sampling_params import SamplingParams
from tests.waiting import async_wait_until

STEP_S = 0.002


class OneTokenPerStep:
    """LLMEngine's step contract: every running request gets one token per step."""

    config = EngineConfig(model="fake")
    tokenizer = None
    model_name = "fake"
    limits = RequestLimits(vocab_size=100, max_model_len=1000, max_logprobs=0, num_blocks=100, block_size=16)

    def __init__(self) -> None:
        self.requests: dict[str, list] = {}
        self.num_steps = 0
        self.last_error = None

    def add_request(self, request_id, prompt, params, arrival_time=None):
        self.requests[request_id] = [len(prompt), 0, params.max_tokens, arrival_time]

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def check_workers(self):
        return None  # one rank: nothing to check, an idle wait has no end

    def get_stats(self):
        return EngineStats(num_running=len(self.requests), num_free_blocks=100, num_total_blocks=100)

    def step(self):
        time.sleep(STEP_S)  # a step takes time: the behaviour this fake engine stands for
        self.num_steps += 1
        deltas = []
        for request_id, r in list(self.requests.items()):
            r[1] += 1
            done = r[1] >= r[2]
            deltas.append(RequestDelta(request_id, [7], "x", done, "length" if done else None, None, r[0], r[1],
                                       RequestSummary(r[3]) if done else None))
            if done:
                del self.requests[request_id]
        return deltas


class CountingEngine(AsyncLLMEngine):
    num_takes = 0

    def _hand_off(self, *args) -> None:
        self.num_takes += 1
        super()._hand_off(*args)


def test_hand_offs_queued_while_the_loop_is_busy_are_taken_together_and_flushed_once():
    fake = OneTokenPerStep()
    engine = CountingEngine(InProcessEngineClient(fake), max_waiting_requests=16, max_running=16)
    num_tokens = 40

    async def main():
        engine.start()
        try:
            streams = [await engine.add_request(f"r{i}", [1, 2], SamplingParams(max_tokens=num_tokens))
                       for i in range(2)]
            events: dict[str, list] = {s.request_id: [] for s in streams}
            for stream in streams:
                log = events[stream.request_id]
                stream.attach(lambda d, log=log: log.append(d.num_output_tokens),
                              lambda error, log=log: log.append(error), lambda log=log: log.append("flush"))
            # this loop iteration ends: its adds go to the engine
            await async_wait_until(lambda: len(fake.requests) == 2, timeout=5, interval=0.001,
                                   message="both requests in the engine")
            time.sleep(num_tokens * STEP_S / 2)  # the event loop is busy while the engine steps on: under test
            await async_wait_until(lambda: all(s.finished for s in streams), interval=STEP_S,
                                   message="both streams finished")
            return events
        finally:
            await engine.shutdown()

    events = asyncio.run(main())
    for log in events.values():
        assert [e for e in log if e != "flush"] == list(range(1, num_tokens + 1))  # every delta, in order
        assert log[-1] == "flush" and "flush" not in log[:1]
        assert all(not (a == b == "flush") for a, b in zip(log, log[1:]))  # a flush follows deltas, once
        runs = "".join("f" if e == "flush" else "d" for e in log).split("f")
        assert max(len(run) for run in runs) >= 4  # the busy stretch's steps came in one flush
    assert engine.num_takes < fake.num_steps
