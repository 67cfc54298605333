"""KVEventFeed (Ray-free): a batch per stats period, a snapshot instead when the batch says
resync, after a failed poll, and every `snapshot_every` periods."""

import asyncio

import pytest

from roseray.engine.kv_events import KVEventLog
from roseray.ray_serve.kv_event_feed import KVEventFeed
from roseray.runtime.errors import EngineUnavailableError


class FakeEngine:
    """AsyncLLMEngine.kv_events over a KVEventLog and a set of cached hashes."""

    def __init__(self) -> None:
        self.log = KVEventLog(max_pending=4, epoch=9)
        self.cached: set[int] = set()
        self.fail = False

    def store(self, *hashes: int) -> None:
        for h in hashes:
            self.cached.add(h)
            if self.log.enabled:
                self.log.stored(h)

    async def kv_events(self, snapshot: bool = False):
        if self.fail:
            raise EngineUnavailableError("gone")
        self.log.enable(cache_empty=not self.cached)
        return self.log.snapshot(sorted(self.cached)) if snapshot else self.log.drain()


def test_batches_snapshots_on_resync_failure_and_period():
    async def body():
        engine = FakeEngine()
        feed = KVEventFeed(engine, snapshot_every=4)
        engine.store(1)  # cached before the log started: the first batch says resync -> a snapshot
        assert await feed.poll() == {"snapshot": {"epoch": 9, "seq": 1, "hashes": [1]}}
        engine.store(2)
        assert (await feed.poll())["batch"]["stored"] == [2]
        engine.store(3, 4, 5, 6, 7)  # more than max_pending: the backlog is dropped -> a snapshot
        assert await feed.poll() == {"snapshot": {"epoch": 9, "seq": 3, "hashes": [1, 2, 3, 4, 5, 6, 7]}}
        assert "snapshot" in await feed.poll()  # period 4 of 4: the safety net
        engine.fail = True
        assert await feed.poll() is None
        engine.fail = False
        assert "snapshot" in await feed.poll()  # the failed poll's batch may be lost
        assert (await feed.poll())["batch"]["stored"] == []

    asyncio.run(body())


def test_snapshot_every_must_be_positive():
    with pytest.raises(ValueError):
        KVEventFeed(FakeEngine(), 0)
