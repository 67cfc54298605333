"""The Router's index of what each engine replica holds in its prefix cache (Ray-free).

Per replica: the set of cached chain hashes (roseray.engine.block_hash), kept current by
applying the replica's KV event batches (roseray.engine.kv_events) in sequence order.
A batch whose sequence number is not the next one (a lost batch), a batch that says
`resync` (the engine dropped a backlog), or the first contact with a replica mid-epoch
marks the view stale: `apply` then answers that it needs a snapshot, and until one comes
the replica counts as holding nothing (routing on a view known to be wrong would send
requests for a cache that may be gone). A new epoch is a restarted engine: its cache is
empty, so the view starts over empty (and a first batch of the epoch applies directly).

`longest_cached_prefix(replica, chain)` is what a cache-aware policy scores with: the
number of leading blocks of a request's chain the replica holds. `view_age` is how long
ago the replica's view was last confirmed (a batch or snapshot applied); `content_age` is
how old the cache contents it shows are: since the replica drained the batch (or took the
snapshot) last applied, by the `as_of` time the caller passes along (the `ts` of the
routing-stats dict that carried it, on the replica's clock), so it includes the delivery
from the replica to the Router. The staleness report (BENCHMARKS.md) is its 99th percentile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch


@dataclass(slots=True)
class ReplicaCacheView:
    """The index's picture of one replica's prefix cache."""

    epoch: int
    seq: int = 0  # the last batch (or snapshot) applied
    hashes: set[int] = field(default_factory=set)
    stale: bool = False  # a batch was missed: waiting for a snapshot
    confirmed_at: float | None = None  # clock time of the last batch or snapshot applied
    as_of: float | None = None  # when the replica took the contents last applied (its clock), if told


class KVCacheIndex:
    """Cached chain hashes per replica, from their event batches and snapshots."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._views: dict[Hashable, ReplicaCacheView] = {}

    def apply(self, replica: Hashable, batch: KVEventBatch, as_of: float | None = None) -> bool:
        """Apply a replica's next batch (drained at `as_of`, if known); True when the view is
        stale and needs a snapshot."""
        view = self._views.get(replica)
        if view is None or batch.epoch != view.epoch:  # first contact or a restart: the cache starts empty
            view = self._views[replica] = ReplicaCacheView(batch.epoch)
        if batch.seq <= view.seq:  # a batch already covered (by a snapshot, or delivered twice)
            return view.stale
        if view.stale or batch.resync or batch.seq != view.seq + 1:
            self._mark_stale(view, batch.seq)
            return True
        hashes = view.hashes
        if batch.cleared:
            hashes.clear()
        hashes.difference_update(batch.removed)
        hashes.update(batch.stored)
        view.seq = batch.seq
        view.confirmed_at = self._clock()
        view.as_of = as_of
        return False

    def apply_snapshot(self, replica: Hashable, snapshot: KVCacheSnapshot, as_of: float | None = None) -> None:
        """Replace the replica's view by a snapshot taken at `as_of`, if known (batches after
        `snapshot.seq` apply on top)."""
        self._views[replica] = ReplicaCacheView(snapshot.epoch, snapshot.seq, set(snapshot.hashes),
                                                confirmed_at=self._clock(), as_of=as_of)

    @staticmethod
    def _mark_stale(view: ReplicaCacheView, seq: int) -> None:
        view.stale = True
        view.seq = max(view.seq, seq)
        view.hashes = set()
        view.confirmed_at = view.as_of = None

    def covers(self, replica: Hashable, epoch: int, seq: int) -> bool:
        """Whether the replica's view is current (not stale) as of a batch after `seq` of `epoch`:
        a snapshot taken after batch `seq` (it holds the events after that batch too) would tell
        it nothing new."""
        view = self._views.get(replica)
        return view is not None and not view.stale and view.epoch == epoch and view.seq > seq

    def needs_snapshot(self, replica: Hashable) -> bool:
        view = self._views.get(replica)
        return view is not None and view.stale

    def longest_cached_prefix(self, replica: Hashable, chain: Sequence[int]) -> int:
        """How many leading blocks of `chain` (a request's chain hashes, first block first) the
        replica holds; 0 for an unknown or stale replica."""
        view = self._views.get(replica)
        if view is None or view.stale:
            return 0
        hashes = view.hashes
        count = 0
        for block_hash in chain:
            if block_hash not in hashes:
                break
            count += 1
        return count

    def cached_hashes(self, replica: Hashable) -> frozenset[int]:
        """The replica's cached chain hashes as the index sees them (empty when unknown or stale)."""
        view = self._views.get(replica)
        return frozenset() if view is None or view.stale else frozenset(view.hashes)

    def view_age(self, replica: Hashable, now: float | None = None) -> float | None:
        """Seconds since the replica's view was last confirmed; None if it never was (or is stale)."""
        view = self._views.get(replica)
        if view is None or view.stale or view.confirmed_at is None:
            return None
        return (self._clock() if now is None else now) - view.confirmed_at

    def content_age(self, replica: Hashable, now: float) -> float | None:
        """Seconds from when the replica took the contents the view shows (`as_of`) to `now` (the
        same clock as `as_of`); None if unknown, stale, or applied without an `as_of`."""
        view = self._views.get(replica)
        if view is None or view.stale or view.as_of is None:
            return None
        return now - view.as_of

    def replicas(self) -> list[Hashable]:
        return list(self._views)

    def forget(self, replica: Hashable) -> None:
        """Drop a replica that left (its cache went with it)."""
        self._views.pop(replica, None)
