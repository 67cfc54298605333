"""The block manager keeps exact accounting under any sequence of operations."""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from roseray.engine.block_manager import BlockManager
from roseray.engine.request import Request
from roseray.sampling_params import SamplingParams

BLOCK = 4


def make_request(i: int, tokens: list[int]) -> Request:
    return Request(f"r{i}", tokens, SamplingParams(max_tokens=8), max_tokens=8)


def compute(bm: BlockManager, req: Request, n: int) -> None:
    """What the engine does after a step computed `n` tokens of `req`."""
    req.num_computed_tokens += n
    bm.commit_full_blocks(req)


def test_prefix_hit_reuses_blocks_and_counts():
    bm = BlockManager(num_blocks=16, block_size=BLOCK, max_num_seqs=4, max_blocks_per_seq=8)
    first = make_request(0, list(range(10)))  # 2 full blocks + 2 tokens
    assert bm.allocate_prefix(first, 100)
    compute(bm, first, 10)
    first_blocks = bm.block_tables[first.row, :2].tolist()
    bm.release(first)  # finished: cached blocks stay, evictable
    assert bm.num_free_blocks == 16

    second = make_request(1, list(range(9)) + [99])
    assert bm.allocate_prefix(second, 100)
    assert second.num_computed_tokens == 8  # two blocks from the cache
    assert bm.block_tables[second.row, :2].tolist() == first_blocks
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 20
    bm.check_integrity([second])


def test_last_prompt_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=BLOCK, max_num_seqs=2, max_blocks_per_seq=4)
    req = make_request(0, list(range(8)))
    assert bm.allocate_prefix(req, 100)
    compute(bm, req, 8)
    bm.free(req)
    again = make_request(1, list(range(8)))
    assert bm.allocate_prefix(again, 100)
    assert again.num_computed_tokens == 4  # the second block holds the last token: recomputed


def test_eviction_takes_least_recently_freed_and_unpublishes_it():
    bm = BlockManager(num_blocks=2, block_size=BLOCK, max_num_seqs=2, max_blocks_per_seq=2)
    req = make_request(0, list(range(8)))
    assert bm.allocate_prefix(req, 100)
    compute(bm, req, 8)
    bm.release(req)
    other = make_request(1, [50 + i for i in range(8)])
    assert bm.allocate_prefix(other, 100)  # evicts both cached blocks
    assert other.num_computed_tokens == 0
    bm.check_integrity([other])
    assert not bm._hash_to_block


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BLOCK, max_num_seqs=2, max_blocks_per_seq=4)
    big = make_request(0, list(range(16)))
    assert not bm.allocate_prefix(big, 16)
    assert bm.num_free_blocks == 3 and big.row == -1
    bm.check_integrity([big])  # it still waits
    bm.release(big)
    bm.check_integrity([])


class BlockManagerMachine(RuleBasedStateMachine):
    """allocate, append (decode / chunk), prefix hits, free, preempt: never a leak."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BLOCK, max_num_seqs=4, max_blocks_per_seq=6)
        self.live: list[Request] = []
        self.counter = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
          tail=st.lists(st.integers(0, 20), min_size=1, max_size=10), chunk=st.integers(1, 12))
    def admit(self, prefix, tail, chunk):
        req = make_request(self.counter, prefix + tail)
        self.counter += 1
        free_before = self.bm.num_free_blocks
        if self.bm.allocate_prefix(req, chunk):
            compute(self.bm, req, min(chunk, req.num_tokens - req.num_computed_tokens))
            self.live.append(req)
        else:
            assert self.bm.num_free_blocks == free_before and req.row == -1
            self.bm.release(req)  # not admitted: it leaves (its hashes with it)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def step(self, data, n):
        req = data.draw(st.sampled_from(self.live))
        if req.num_computed_tokens == req.num_tokens:  # decode: a new token arrives
            if req.num_tokens == 6 * BLOCK:
                return  # the block table is full (the engine caps requests at max_model_len)
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
        if not preempt:  # finished
            self.bm.release(req)
            return
        self.bm.free(req)  # preemption by recompute: the request comes back from scratch
        req.num_computed_tokens = 0
        if self.bm.allocate_prefix(req, req.num_tokens):
            compute(self.bm, req, req.num_tokens - req.num_computed_tokens)
            self.live.append(req)
        else:
            self.bm.release(req)

    @invariant()
    def accounting_is_exact(self):
        self.bm.check_integrity(self.live)
        used = sum(1 for c in self.bm.ref_counts if c > 0)
        assert used + self.bm.num_free_blocks == self.bm.num_blocks

    def teardown(self):
        for req in self.live:
            self.bm.release(req)
        self.bm.check_integrity([])
        assert self.bm.num_free_blocks == self.bm.num_blocks  # nothing leaks once no request is left


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_a_request_longer_than_a_block_table_is_refused_without_side_effects():
    bm = BlockManager(num_blocks=16, block_size=BLOCK, max_num_seqs=2, max_blocks_per_seq=2)
    try:
        bm.allocate_prefix(make_request(0, list(range(9))), 100)
    except ValueError as exc:
        assert "more than a block table holds" in str(exc)
    else:
        raise AssertionError("expected a ValueError")
    bm.check_integrity([])
