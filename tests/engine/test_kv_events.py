"""KV cache events: the Router's index agrees with the engine's prefix cache; block hashes
are stable across processes."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from roseray import LLM, SamplingParams
from roseray.engine.block_hash import block_chain, extend_chain, hash_block
from roseray.engine.block_manager import BlockManager
from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch, KVEventLog
from roseray.engine.request import Request
from roseray.ray_serve.kv_index import KVCacheIndex

BLOCK = 4
TOKENS = list(range(1000, 1000 + 10 * BLOCK + 3))


def make_request(i: int, tokens: list[int]) -> Request:
    return Request(f"r{i}", tokens, SamplingParams(max_tokens=8), max_tokens=8)


def compute(bm: BlockManager, req: Request, n: int) -> None:
    """What the engine does after a step computed `n` tokens of `req`."""
    req.num_computed_tokens += n
    bm.commit_full_blocks(req)


def cached_hashes(bm: BlockManager) -> set[int]:
    """The prefix cache's contents from the block arrays (not from the hash map the events mirror)."""
    return {int(bm.block_hashes[b]) for b in np.flatnonzero(bm.is_cached)}


def sync(index: KVCacheIndex, replica: str, bm: BlockManager) -> bool:
    """One consumer period: apply the drained batch, resync from a snapshot if asked. Returns whether it asked."""
    needed = index.apply(replica, bm.drain_kv_events())
    if needed:
        index.apply_snapshot(replica, bm.kv_cache_snapshot())
    return needed


# ---- stable hashes -----------------------------------------------------------------------------
_CHILD = "from roseray.engine.block_hash import block_chain; print(block_chain(list(range(1000, 1043)), 4))"


def test_block_hashes_are_equal_in_another_process():
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a salted hash() would differ here
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    assert eval(out.stdout) == block_chain(TOKENS, BLOCK)


def test_block_hashes_are_pinned():
    """The chain is part of the wire format between engines and the Router: a change of the
    hash function must be deliberate (every replica and router upgraded together)."""
    chain = block_chain(TOKENS, BLOCK)
    assert len(chain) == 10
    assert chain[0] == hash_block(0x5EED, TOKENS[:BLOCK])
    assert chain[:2] == [-3133014748970780945, 1865414412563012618]
    assert all(-(2**63) <= h < 2**63 for h in chain)  # fits the block manager's int64 array


def test_extend_chain_equals_one_block_at_a_time():
    hashes: list[int] = []
    for n in (1, 1, 3, 3, 7, 10):
        extend_chain(hashes, TOKENS, BLOCK, n)
    assert hashes == block_chain(TOKENS, BLOCK)
    assert block_chain(TOKENS[:5] + [7] + TOKENS[6:], BLOCK)[1:] != hashes[1:10]  # one token changes the rest


# ---- the event log -------------------------------------------------------------------------------
def test_a_batch_states_each_hash_final_presence():
    log = KVEventLog(max_pending=100, epoch=7)
    log.enable(cache_empty=True)
    for event, h in [("stored", 1), ("stored", 2), ("removed", 1), ("stored", 3), ("removed", 3), ("stored", 3),
                     ("removed", 4)]:
        getattr(log, event)(h)
    batch = log.drain()
    assert (batch.epoch, batch.seq, set(batch.stored), set(batch.removed)) == (7, 1, {2, 3}, {1, 4})
    assert not batch.resync and not batch.cleared
    assert log.drain() == KVEventBatch(7, 2, (), ())
    log.stored(5)
    log.cleared()
    log.stored(6)
    assert log.drain() == KVEventBatch(7, 3, (6,), (), cleared=True)


def test_a_backlog_beyond_the_bound_is_dropped_and_the_next_batch_asks_for_a_resync():
    log = KVEventLog(max_pending=4, epoch=1)
    log.enable(cache_empty=True)
    for h in range(6):
        log.stored(h)
    assert len(log._events) <= 4 and log.num_dropped_batches == 1
    batch = log.drain()
    assert batch.resync and batch.stored == (5,)
    assert not log.drain().resync  # answered once


def test_nothing_is_recorded_until_a_consumer_enables_the_events():
    bm = BlockManager(num_blocks=8, block_size=BLOCK, max_num_seqs=2, max_blocks_per_seq=4)
    req = make_request(0, TOKENS[:9])
    assert bm.allocate_prefix(req, 100)
    compute(bm, req, 9)
    assert not bm.kv_events._events and not bm.kv_events.enabled
    index = KVCacheIndex()
    assert index.apply("a", bm.drain_kv_events())  # late consumer: the cache was not empty
    index.apply_snapshot("a", bm.kv_cache_snapshot())
    assert index.cached_hashes("a") == cached_hashes(bm) and len(cached_hashes(bm)) == 2


def test_kv_cache_snapshot_of_an_engine():
    llm = LLM("random:tiny", device="cpu", block_size=4, enable_prefix_caching=True)
    engine = llm.engine
    first = engine.drain_kv_events()  # the consumer starts on an empty cache: no resync needed
    assert first.seq == 1 and not first.resync and not first.stored
    prompt = list(range(3, 3 + 17))
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    batch = engine.drain_kv_events()
    chain = block_chain(prompt, 4)
    assert batch.epoch == first.epoch and batch.seq == 2
    assert set(chain) <= set(batch.stored)  # the Router's chain of the prompt is what the engine stored
    snapshot = engine.kv_cache_snapshot()
    assert (snapshot.epoch, snapshot.seq) == (first.epoch, 2) and set(snapshot.hashes) == set(batch.stored)
    index = KVCacheIndex()
    index.apply("a", first)
    index.apply("a", batch)
    assert index.longest_cached_prefix("a", chain) == 4
    assert index.longest_cached_prefix("a", block_chain([9] + prompt[1:], 4)) == 0


# ---- the block manager driven at random, the index following it -------------------------------------
class EventStreamMachine(RuleBasedStateMachine):
    """allocate, append, free, preempt, evict, reset the cache, restart the engine; the consumer
    drains after random numbers of operations, loses batches, and takes unasked snapshots."""

    def __init__(self):
        super().__init__()
        self.index = KVCacheIndex()
        self.counter = 0
        self._start_engine()

    def _start_engine(self):
        self.bm = BlockManager(num_blocks=12, block_size=BLOCK, max_num_seqs=4, max_blocks_per_seq=6)
        self.bm.kv_events.max_pending = 4  # small, so that slow consumers overflow it
        self.live: list[Request] = []
        self.expect_resync = False  # a batch was lost or the backlog dropped since the view agreed
        self.dropped_before = 0
        # the consumer starts with the engine (an empty cache): the epoch's first batch applies directly
        assert not self.index.apply("replica", self.bm.drain_kv_events())
        assert self.index.cached_hashes("replica") == frozenset()

    @rule(prefix=st.sampled_from([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
          tail=st.lists(st.integers(0, 20), min_size=1, max_size=10), chunk=st.integers(1, 12))
    def admit(self, prefix, tail, chunk):
        req = make_request(self.counter, prefix + tail)
        self.counter += 1
        if self.bm.allocate_prefix(req, chunk):
            compute(self.bm, req, min(chunk, req.num_tokens - req.num_computed_tokens))
            self.live.append(req)
        else:
            self.bm.release(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def step(self, data, n):
        req = data.draw(st.sampled_from(self.live))
        if req.num_computed_tokens == req.num_tokens:  # decode: a new token arrives
            if req.num_tokens == 6 * BLOCK:
                return
            req.token_ids.append(data.draw(st.integers(0, 20)))
            n = 1
        n = min(n, req.num_tokens - req.num_computed_tokens)
        if self.bm.append_slots(req, n):
            compute(self.bm, req, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data, preempt):
        req = data.draw(st.sampled_from(self.live))
        self.live.remove(req)
        if not preempt:
            self.bm.release(req)
            return
        self.bm.free(req)
        req.num_computed_tokens = 0
        if self.bm.allocate_prefix(req, req.num_tokens):
            compute(self.bm, req, req.num_tokens - req.num_computed_tokens)
            self.live.append(req)
        else:
            self.bm.release(req)

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()
        self.bm.check_integrity(self.live)
        assert not cached_hashes(self.bm)

    @rule()
    def restart_engine(self):
        """The old engine's cache is gone: its view is dropped by the new epoch's first batch."""
        old_epoch = self.bm.kv_events.epoch
        self._start_engine()
        assert self.bm.kv_events.epoch != old_epoch

    @rule()
    def lose_a_batch(self):
        self.bm.drain_kv_events()
        self.expect_resync = True

    @rule()
    def unasked_snapshot(self):
        """A periodic snapshot while events are pending: they reach the view again, harmlessly."""
        self.index.apply_snapshot("replica", self.bm.kv_cache_snapshot())
        self.expect_resync = False
        self.dropped_before = self.bm.kv_events.num_dropped_batches
        assert self.index.cached_hashes("replica") == cached_hashes(self.bm)

    @rule()
    def drain(self):
        overflowed = self.bm.kv_events.num_dropped_batches > self.dropped_before
        asked = sync(self.index, "replica", self.bm)
        assert asked == (self.expect_resync or overflowed)
        self.expect_resync = False
        self.dropped_before = self.bm.kv_events.num_dropped_batches
        assert not self.index.needs_snapshot("replica")
        truth = cached_hashes(self.bm)
        assert self.index.cached_hashes("replica") == truth
        assert truth == set(self.bm.kv_cache_snapshot().hashes)
        for req in self.live:  # the index answers what the engine's own prefix match would find
            chain = block_chain(req.token_ids, BLOCK)
            held = 0
            while held < len(chain) and chain[held] in truth:
                held += 1
            assert self.index.longest_cached_prefix("replica", chain) == held

    def teardown(self):
        self.bm.check_integrity(self.live)


TestEventStreamMachine = EventStreamMachine.TestCase
TestEventStreamMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


def test_seeded_random_operations_keep_the_index_equal_to_the_cache():
    """The same agreement as the state machine, over one long seeded run that must exercise every
    path (evictions, overflowed backlogs, lost batches, resets, restarts: counted and asserted)."""
    rng = random.Random(28)
    prefixes = [[p] * BLOCK * n for p in range(6) for n in (1, 2, 3)]
    index, seen = KVCacheIndex(), collections.Counter()
    bm, live, expect_resync, dropped_before = None, [], False, 0

    def start():
        engine = BlockManager(num_blocks=10, block_size=BLOCK, max_num_seqs=3, max_blocks_per_seq=6)
        engine.kv_events.max_pending = 8
        assert not index.apply("a", engine.drain_kv_events())  # a new epoch's first batch: a fresh, empty view
        assert index.cached_hashes("a") == frozenset()
        return engine

    bm = start()
    for i in range(6000):
        op = rng.random()
        if not live and op < 0.70:
            op = 0.0  # nothing to step or free: admit
        if op < 0.25:
            req = make_request(i, rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))])
            chunk = rng.randrange(1, 12)
            if bm.allocate_prefix(req, chunk):
                compute(bm, req, min(chunk, req.num_tokens - req.num_computed_tokens))
                live.append(req)
            else:
                bm.release(req)
        elif op < 0.55 and live:
            req = rng.choice(live)
            if req.num_computed_tokens == req.num_tokens and req.num_tokens < 6 * BLOCK:
                req.token_ids.append(rng.randrange(50))
            n = min(rng.randrange(1, 6), req.num_tokens - req.num_computed_tokens)
            if n and bm.append_slots(req, n):
                compute(bm, req, n)
        elif op < 0.70 and live:
            req = live.pop(rng.randrange(len(live)))
            bm.free(req)
            req.num_computed_tokens = 0
            if rng.random() < 0.3 and bm.allocate_prefix(req, req.num_tokens):  # preempted, readmitted
                compute(bm, req, req.num_tokens - req.num_computed_tokens)
                live.append(req)
            else:
                bm.release(req)
        elif op < 0.705:
            bm.reset_prefix_cache()
            seen["reset"] += 1
        elif op < 0.708:
            bm, live, expect_resync, dropped_before = start(), [], False, 0
            seen["restart"] += 1
        elif op < 0.73:
            bm.drain_kv_events()  # lost on the way
            expect_resync = True
            seen["lost"] += 1
        elif op < 0.76:  # a periodic snapshot, asked for or not: it answers a pending resync too
            seen["snapshot over a dropped backlog"] += bm.kv_events.num_dropped_batches > dropped_before
            index.apply_snapshot("a", bm.kv_cache_snapshot())
            expect_resync, dropped_before = False, bm.kv_events.num_dropped_batches
            assert index.cached_hashes("a") == cached_hashes(bm)
        elif op < 0.85:
            overflowed = bm.kv_events.num_dropped_batches > dropped_before
            batch = bm.drain_kv_events()
            seen["removed"] += len(batch.removed)
            seen["cleared"] += batch.cleared
            asked = index.apply("a", batch)
            assert asked == (expect_resync or overflowed)
            if asked:
                seen["overflow" if overflowed else "gap"] += 1
                index.apply_snapshot("a", bm.kv_cache_snapshot())
            expect_resync, dropped_before = False, bm.kv_events.num_dropped_batches
            assert index.cached_hashes("a") == cached_hashes(bm)
            seen["agreed"] += 1
    bm.check_integrity(live)
    assert min(seen[k] for k in ("reset", "restart", "lost", "removed", "cleared", "overflow", "gap",
                                 "snapshot over a dropped backlog")) > 0, seen
    assert seen["agreed"] > 300, seen


@pytest.mark.parametrize("lost", [0, 1, 3])
def test_a_lost_batch_is_answered_by_a_snapshot(lost):
    bm = BlockManager(num_blocks=16, block_size=BLOCK, max_num_seqs=2, max_blocks_per_seq=4)
    index = KVCacheIndex()
    assert not sync(index, "a", bm)
    for i in range(lost + 1):
        req = make_request(i, [i] * 9)
        assert bm.allocate_prefix(req, 100)
        compute(bm, req, 9)
        bm.release(req)
        if i < lost:
            bm.drain_kv_events()  # lost on the way
    assert index.apply("a", bm.drain_kv_events()) == (lost > 0)
    if lost:
        assert index.needs_snapshot("a") and index.cached_hashes("a") == frozenset()
        assert index.view_age("a") is None
        index.apply_snapshot("a", bm.kv_cache_snapshot())
    assert index.cached_hashes("a") == cached_hashes(bm) and len(cached_hashes(bm)) == 2 * (lost + 1)


def test_the_snapshot_round_trips_through_plain_types():
    bm = BlockManager(num_blocks=8, block_size=BLOCK, max_num_seqs=2, max_blocks_per_seq=4)
    bm.drain_kv_events()
    req = make_request(0, TOKENS[:9])
    assert bm.allocate_prefix(req, 100)
    compute(bm, req, 9)
    batch, snapshot = bm.drain_kv_events(), bm.kv_cache_snapshot()
    assert KVEventBatch.from_dict(batch.to_dict()) == batch
    assert KVCacheSnapshot.from_dict(snapshot.to_dict()) == snapshot
    assert set(snapshot.hashes) == set(batch.stored) == set(block_chain(TOKENS[:9], BLOCK))
