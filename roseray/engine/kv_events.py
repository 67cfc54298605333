"""KV cache events: what entered and left an engine's prefix cache, for the Router's index.

The block manager reports each full block's chain hash (block_hash.py: the same in every
process) when the block enters the prefix cache ("stored") and when it leaves it (evicted
for reuse: "removed"), and "cleared" when the whole cache is reset. Nothing is recorded
until a consumer enables the log (the first `drain` or `snapshot`), so an engine nobody
watches pays one attribute check per cache change.

A consumer drains the log into a `KVEventBatch`: the replica's epoch (random, chosen when
the engine starts, so a restart shows as a new epoch), a sequence number one above the
previous batch's (a gap means a lost batch), and the batch's net effect: the hashes whose
last event was a store and those whose last event was a removal (disjoint, so applying
them in any order gives the engine's state), after `cleared` if the cache was reset in it.

The log is bounded: a consumer that does not drain for `max_pending` events loses the
backlog, and its next batch says `resync` — take a `KVCacheSnapshot` (every cached hash)
instead, which is what the backlog would have cost anyway. A snapshot covers every event
so far; events still pending when it is taken reach the consumer again in the next
batch, which is harmless because a batch states each hash's final presence.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The change of one replica's prefix cache since its previous batch."""

    epoch: int  # the engine's random id: a new one means a restart (an empty cache)
    seq: int  # 1 for the epoch's first batch, then +1 per batch
    stored: tuple[int, ...]  # chain hashes now cached
    removed: tuple[int, ...]  # chain hashes no longer cached
    cleared: bool = False  # the cache was emptied before `stored`/`removed`
    resync: bool = False  # events were dropped before this batch: the consumer needs a snapshot

    def to_dict(self) -> dict:
        """Plain types (ints, lists), for a stats dict or a message."""
        return {"epoch": self.epoch, "seq": self.seq, "stored": list(self.stored), "removed": list(self.removed),
                "cleared": self.cleared, "resync": self.resync}

    @classmethod
    def from_dict(cls, data: dict) -> KVEventBatch:
        return cls(int(data["epoch"]), int(data["seq"]), tuple(data["stored"]), tuple(data["removed"]),
                   bool(data.get("cleared", False)), bool(data.get("resync", False)))


@dataclass(frozen=True, slots=True)
class KVCacheSnapshot:
    """Every chain hash one replica holds, as of batch `seq` of `epoch` (and any events after it)."""

    epoch: int
    seq: int
    hashes: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "seq": self.seq, "hashes": list(self.hashes)}

    @classmethod
    def from_dict(cls, data: dict) -> KVCacheSnapshot:
        return cls(int(data["epoch"]), int(data["seq"]), tuple(data["hashes"]))


_STORED, _REMOVED = True, False


class KVEventLog:
    """The block manager's events since the last drain, in order (one owner thread: the engine's)."""

    def __init__(self, max_pending: int, epoch: int | None = None) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        self.epoch = secrets.randbits(63) if epoch is None else epoch
        self.max_pending = max_pending
        self.seq = 0  # the last batch handed out
        self.enabled = False
        self._events: list[tuple[bool, int]] = []  # (stored?, hash), oldest first
        self._cleared = False  # a reset happened since the last drain (events before it are gone)
        self._resync = False  # events were dropped since the last drain or snapshot
        self.num_dropped_batches = 0  # backlogs dropped for a slow consumer

    def enable(self, cache_empty: bool) -> None:
        """Start recording. A consumer that starts on a cache already holding blocks missed
        their stores: its first batch asks for a snapshot."""
        if not self.enabled:
            self.enabled = True
            self._resync = not cache_empty

    # ---- recording (the block manager, only while enabled) -----------------------------------
    def stored(self, block_hash: int) -> None:
        self._events.append((_STORED, block_hash))
        if len(self._events) > self.max_pending:
            self._drop_backlog()

    def removed(self, block_hash: int) -> None:
        self._events.append((_REMOVED, block_hash))
        if len(self._events) > self.max_pending:
            self._drop_backlog()

    def cleared(self) -> None:
        self._events.clear()
        self._cleared = True

    def _drop_backlog(self) -> None:
        self._events.clear()
        self._cleared = False
        self._resync = True
        self.num_dropped_batches += 1

    # ---- consuming -----------------------------------------------------------------------------
    def drain(self) -> KVEventBatch:
        """The next batch: the net effect of the events since the previous one (possibly none)."""
        final: dict[int, bool] = {}
        for is_stored, block_hash in self._events:
            final[block_hash] = is_stored
        stored = tuple(h for h, is_stored in final.items() if is_stored)
        removed = tuple(h for h, is_stored in final.items() if not is_stored)
        self.seq += 1
        batch = KVEventBatch(self.epoch, self.seq, stored, removed, self._cleared, self._resync)
        self._events.clear()
        self._cleared = self._resync = False
        return batch

    def snapshot(self, cached_hashes: list[int]) -> KVCacheSnapshot:
        """A snapshot of `cached_hashes` (the cache now); it answers any pending resync."""
        self._resync = False
        return KVCacheSnapshot(self.epoch, self.seq, tuple(cached_hashes))
