"""How long a request waits between arriving and being first scheduled while the engine
process is busy stepping another request: with the async engine's loop woken out of its wait
for the next step message (EngineProcessClient.wake, on every add), and without (the add then
waits for that message, and the child has started its next step by the time it arrives).
random:tiny on CPU, the engine in its own process; requests arrive one at a time at random
moments while a long greedy request streams. CPU only.

    python scripts/queue_time_mid_step.py [--requests 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics

from roseray.config import EngineConfig
from roseray.engine.async_engine import AsyncLLMEngine
from roseray.sampling_params import SamplingParams


async def _queue_times(engine: AsyncLLMEngine, num_requests: int, seed: int) -> list[float]:
    """first_scheduled_time - arrival_time of `num_requests` one-token requests, each sent at
    a random moment while a long request streams."""
    async def long() -> None:
        stream = await engine.add_request("long", [1, 2, 3], SamplingParams(
            temperature=0.0, max_tokens=1000, ignore_eos=True))
        async for _ in stream:
            pass

    background = asyncio.ensure_future(long())
    await asyncio.sleep(0.3)  # it streams
    rng, waits = random.Random(seed), []
    try:
        for index in range(num_requests):
            await asyncio.sleep(rng.uniform(0.005, 0.03))
            stream = await engine.add_request(f"probe-{index}", [4, 5], SamplingParams(
                temperature=0.0, max_tokens=1, ignore_eos=True))
            async for deltas in stream:
                for delta in deltas:
                    if delta.finished:
                        waits.append(delta.request.first_scheduled_time - delta.request.arrival_time)
            assert not background.done(), "the long request ended early: every probe must meet a busy engine"
    finally:
        background.cancel()
    return waits


def measure(wake: bool, num_requests: int, seed: int) -> list[float]:
    config = EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=256, max_model_len=1024, max_num_seqs=8,
                          engine_process=True)
    engine = AsyncLLMEngine.from_engine_config(config)
    if not wake:
        engine._wake_engine = None  # the loop is woken only by the next step message, as before
    engine.start()
    try:
        return asyncio.run(_queue_times(engine, num_requests, seed))
    finally:
        engine.stop()
        engine._thread.join(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60, help="requests per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way, taking turns")
    args = parser.parse_args()
    for repeat in range(args.repeats):
        for wake in (False, True):
            waits = measure(wake, args.requests, seed=repeat)
            print(f"{'woken' if wake else 'not woken'}: queue time median {statistics.median(waits) * 1e3:.2f} ms, "
                  f"mean {statistics.mean(waits) * 1e3:.2f} ms ({len(waits)} requests)")


if __name__ == "__main__":
    main()
