"""KVEventFeed (Ray-free): a batch per stats period, a snapshot instead when the batch says
resync, after a failed poll, and every `snapshot_every` periods; each poll sends the entries
of the last `window` periods."""

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
        feed = KVEventFeed(engine, snapshot_every=4, window=2)

        async def latest():
            return (await feed.poll())["recent"][-1]

        engine.store(1)  # cached before the log started: the first batch says resync -> a snapshot
        assert await latest() == {"snapshot": {"epoch": 9, "seq": 1, "hashes": [1]}}
        engine.store(2)
        assert (await latest())["batch"]["stored"] == [2]
        engine.store(3, 4, 5, 6, 7)  # more than max_pending: the backlog is dropped -> a snapshot
        assert await latest() == {"snapshot": {"epoch": 9, "seq": 3, "hashes": [1, 2, 3, 4, 5, 6, 7]}}
        assert "snapshot" in await latest()  # period 4 of 4: the safety net
        engine.fail = True
        recent = (await feed.poll())["recent"]  # nothing new: the window as it was
        assert [("snapshot" in e) for e in recent] == [True, True]
        engine.fail = False
        assert "snapshot" in await latest()  # the failed poll's batch may be lost
        assert (await latest())["batch"]["stored"] == []

    asyncio.run(body())


def test_each_poll_sends_the_last_window_of_entries():
    async def body():
        engine = FakeEngine()
        feed = KVEventFeed(engine, snapshot_every=100, window=3)
        for h in range(5):
            engine.store(h)
            recent = (await feed.poll())["recent"]
        assert [e["batch"]["seq"] for e in recent] == [3, 4, 5]
        assert [e["batch"]["stored"] for e in recent] == [[2], [3], [4]]

    asyncio.run(body())


def test_snapshot_every_must_be_positive():
    with pytest.raises(ValueError):
        KVEventFeed(FakeEngine(), 0)
    with pytest.raises(ValueError):
        KVEventFeed(FakeEngine(), 4, window=0)
