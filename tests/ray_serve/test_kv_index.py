"""The Router's KV cache index: batches in order, gaps and restarts, prefix lengths, view ages (Ray-free)."""

from __future__ import annotations

from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch
from roseray.ray_serve.kv_index import KVCacheIndex


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_batches_apply_in_order_and_prefixes_count_leading_blocks():
    index = KVCacheIndex()
    assert not index.apply("a", KVEventBatch(1, 1, stored=(10, 11, 12), removed=()))
    assert not index.apply("a", KVEventBatch(1, 2, stored=(20,), removed=(11,)))
    assert index.cached_hashes("a") == {10, 12, 20}
    assert index.longest_cached_prefix("a", [10, 11, 12]) == 1  # 12 is held, but not after a miss
    assert index.longest_cached_prefix("a", [10]) == 1
    assert index.longest_cached_prefix("a", []) == 0
    assert index.longest_cached_prefix("b", [10]) == 0  # an unknown replica holds nothing
    assert not index.apply("a", KVEventBatch(1, 3, stored=(30,), removed=(), cleared=True))
    assert index.cached_hashes("a") == {30}


def test_a_gap_marks_the_view_stale_until_a_snapshot():
    index = KVCacheIndex()
    index.apply("a", KVEventBatch(1, 1, stored=(10,), removed=()))
    assert index.apply("a", KVEventBatch(1, 3, stored=(11,), removed=()))  # batch 2 was lost
    assert index.needs_snapshot("a") and index.longest_cached_prefix("a", [10]) == 0
    assert index.apply("a", KVEventBatch(1, 4, stored=(), removed=()))  # still stale: still asks
    index.apply_snapshot("a", KVCacheSnapshot(1, 4, (10, 11, 12)))
    assert not index.needs_snapshot("a") and index.longest_cached_prefix("a", [10, 11, 12, 13]) == 3
    assert not index.apply("a", KVEventBatch(1, 4, stored=(99,), removed=()))  # already covered: ignored
    assert not index.apply("a", KVEventBatch(1, 5, stored=(13,), removed=(10,)))
    assert index.cached_hashes("a") == {11, 12, 13}


def test_a_resync_batch_or_a_first_contact_mid_epoch_asks_for_a_snapshot():
    index = KVCacheIndex()
    assert index.apply("a", KVEventBatch(1, 57, stored=(10,), removed=()))  # joined late
    index.apply_snapshot("a", KVCacheSnapshot(1, 57, (10, 11)))
    assert index.apply("a", KVEventBatch(1, 58, stored=(), removed=(), resync=True))
    assert index.cached_hashes("a") == frozenset()


def test_a_new_epoch_empties_the_view():
    index = KVCacheIndex()
    index.apply_snapshot("a", KVCacheSnapshot(1, 9, (10, 11)))
    assert not index.apply("a", KVEventBatch(2, 1, stored=(20,), removed=()))  # restarted: its first batch
    assert index.cached_hashes("a") == {20}
    assert index.apply("a", KVEventBatch(3, 5, stored=(), removed=()))  # restarted, batches 1-4 missed
    assert index.cached_hashes("a") == frozenset() and index.needs_snapshot("a")


def test_view_age_and_forget():
    clock = Clock()
    index = KVCacheIndex(clock)
    assert index.view_age("a") is None
    index.apply("a", KVEventBatch(1, 1, stored=(10,), removed=()))
    clock.now += 2.5
    assert index.view_age("a") == 2.5
    index.apply("a", KVEventBatch(1, 2, stored=(), removed=()))  # an empty batch confirms the view too
    assert index.view_age("a") == 0.0 and index.view_age("a", now=clock.now + 1) == 1.0
    index.apply("a", KVEventBatch(1, 4, stored=(), removed=()))
    assert index.view_age("a") is None  # stale: no age to trust
    assert index.replicas() == ["a"]
    index.forget("a")
    assert index.replicas() == [] and not index.needs_snapshot("a") and index.cached_hashes("a") == frozenset()


def test_content_age_counts_from_when_the_replica_took_the_contents():
    """The age of what the view shows runs from the `as_of` the replica stamped (its stats'
    `ts`), not from when the index applied it: the delivery counts. A batch already applied
    (delivered again) does not make the view younger; a gap leaves no age to trust."""
    clock = Clock()
    index = KVCacheIndex(clock)
    index.apply("a", KVEventBatch(1, 1, stored=(10,), removed=()))
    assert index.view_age("a") == 0.0 and index.content_age("a", clock.now) is None  # no as_of: unknown
    index.apply("a", KVEventBatch(1, 2, stored=(), removed=()), as_of=99.0)  # taken 1 s before it arrived
    assert index.content_age("a", clock.now) == 1.0 and index.view_age("a") == 0.0
    index.apply("a", KVEventBatch(1, 2, stored=(), removed=()), as_of=100.0)  # the same batch again
    assert index.content_age("a", 100.5) == 1.5
    index.apply_snapshot("a", KVCacheSnapshot(1, 5, (10,)), as_of=100.25)
    assert index.content_age("a", 100.5) == 0.25
    index.apply("a", KVEventBatch(1, 7, stored=(), removed=()), as_of=100.5)  # batch 6 lost: stale
    assert index.content_age("a", 101.0) is None and index.content_age("b", 101.0) is None
