"""KV cache events over the engine transports (GetKVEvents / KVEventsReply): the engine on a
thread of this process and in its own process answer a request with the batch of events
since the previous one, and with a snapshot of the whole prefix cache when asked; the
async engine's `kv_events` does the same from asyncio. The hashes are block_hash.py's, so
they equal the chain the Router computes from the prompt's token ids."""

import asyncio
import time

import pytest

from roseray.config import EngineConfig
from roseray.engine.block_hash import block_chain
from roseray.engine.engine import LLMEngine
from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch
from roseray.runtime.async_engine import AsyncLLMEngine
from roseray.runtime.engine_client import EngineClient
from roseray.runtime.in_process_client import InProcessEngineClient
from roseray.runtime.messages import GetKVEvents, KVEventsReply, decode
from roseray.runtime.process_client import EngineProcessClient
from roseray.sampling_params import SamplingParams
from tests.runtime.client_helpers import run_to_end, wait_outputs

PROMPT = list(range(3, 3 + 40))  # two full blocks of 16, and a partial one
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def config(**overrides) -> EngineConfig:
    values = dict(model="random:tiny", device="cpu", num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                  block_size=16)
    return EngineConfig(**{**values, **overrides})


def ask(client: EngineClient, snapshot: bool = False, timeout_s: float = 30.0):
    call_id, deadline = client.send_kv_events_request(snapshot), time.monotonic() + timeout_s
    while not client.kv_events_replied(call_id):
        assert time.monotonic() < deadline, "no KV events reply"
        wait_outputs(client, 1.0)
    return client.take_kv_events(call_id)


def check_events_round_trip(client: EngineClient) -> None:
    first = ask(client)  # enables the log on an empty cache: nothing yet, no resync
    assert isinstance(first, KVEventBatch) and first.seq == 1 and not first.resync
    assert first.stored == () and first.removed == ()
    client.add_request("a", PROMPT, PARAMS)
    run_to_end(client)
    batch = ask(client)
    chain = block_chain(PROMPT, 16)
    assert batch.epoch == first.epoch and batch.seq == 2
    assert set(chain) <= set(batch.stored)
    snapshot = ask(client, snapshot=True)
    assert isinstance(snapshot, KVCacheSnapshot) and snapshot.epoch == first.epoch and snapshot.seq == 2
    assert set(snapshot.hashes) == set(batch.stored)
    assert ask(client).seq == 3  # the next batch follows the snapshot


def test_messages_round_trip():
    batch = KVEventBatch(7, 3, (1, -2), (5,), cleared=True, resync=False)
    snapshot = KVCacheSnapshot(7, 3, (1, -2, 9))
    assert decode(GetKVEvents(4, True).encode()) == GetKVEvents(4, True)
    assert decode(KVEventsReply(4, batch).encode()) == KVEventsReply(4, batch)
    assert decode(KVEventsReply(5, snapshot).encode()) == KVEventsReply(5, snapshot)


def test_in_process_client_returns_batches_and_snapshots():
    client = InProcessEngineClient(LLMEngine(config()))
    try:
        check_events_round_trip(client)
    finally:
        client.close()


def test_engine_process_returns_batches_and_snapshots():
    client = EngineProcessClient(config(engine_process=True))
    try:
        check_events_round_trip(client)
    finally:
        client.close()


@pytest.mark.parametrize("engine_process", [False, True])
def test_async_engine_kv_events(engine_process):
    async def body():
        engine = AsyncLLMEngine.from_engine_config(config(engine_process=engine_process))
        engine.start()
        try:
            assert (await engine.kv_events()).stored == ()
            stream = await engine.add_request("a", PROMPT, PARAMS)
            async for _ in stream:
                pass
            batch = await engine.kv_events()
            assert set(block_chain(PROMPT, 16)) <= set(batch.stored)
            snapshot = await engine.kv_events(snapshot=True)
            assert set(snapshot.hashes) == set(batch.stored)
        finally:
            await engine.shutdown()

    asyncio.run(body())
