"""The warm-up's key lengths reach every split-KV count the attention kernels can pick, so no
count is first compiled under load (pure host arithmetic: runs without a GPU)."""

import pytest

from roseray_kernels.paged_attention import (
    MAX_GENERAL_SPLITS,
    MAX_SPLITS,
    MIN_KEYS_PER_GENERAL_SPLIT,
    MIN_TOKENS_PER_SPLIT,
    general_tiles_bound,
    split_warm_up_lengths,
    splits_for_grid,
)

NUM_SMS = 132


def key_counts(max_len: int) -> list[int]:
    """Every key count that can change a choice (either side of each multiple of 256, up to where
    the most splits are reached), and max_len."""
    top = min(max_len, MAX_SPLITS * MIN_TOKENS_PER_SPLIT + 1)
    return sorted({k for j in range(top // 256 + 2) for k in (256 * j, 256 * j + 1) if 1 <= k <= top} | {max_len})


@pytest.mark.parametrize("max_len", [2, 300, 5000, 40960])
@pytest.mark.parametrize("num_kv_heads", [1, 8, 128])
def test_warm_up_lengths_reach_every_split_count(max_len, num_kv_heads):
    lengths = split_warm_up_lengths(max_len)
    assert lengths == sorted(set(lengths)) and all(min(2, max_len) <= n <= max_len for n in lengths)
    keys = key_counts(max_len)
    grid_full = 2 * NUM_SMS  # programs from which no kernel splits
    # decode: one program per (sequence, KV head); the warm-up runs one sequence
    reachable = {splits_for_grid(s * num_kv_heads, k, NUM_SMS, MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
                 for s in range(1, grid_full + 1) for k in keys}
    warmed = {splits_for_grid(num_kv_heads, k, NUM_SMS, MIN_TOKENS_PER_SPLIT, MAX_SPLITS) for k in lengths}
    assert warmed == reachable
    # general: a step of t >= 2 query tokens over s sequences has t // block_q + s tiles (any count
    # from 2 // block_q + 1 up); the warm-up runs one sequence of min(2, keys) query tokens
    for block_q in (1, 16, 64):
        for window in (None, 700):  # a window layer reads its span at most
            span = (lambda k: k) if window is None else (lambda k, w=window + 16 + block_q: min(k, w))
            least = general_tiles_bound(2, 1, block_q)
            reachable = {splits_for_grid(tiles * num_kv_heads, span(k), NUM_SMS, MIN_KEYS_PER_GENERAL_SPLIT,
                                         MAX_GENERAL_SPLITS)
                         for tiles in range(least, grid_full + 1) for k in keys if k >= 2}
            warmed = {splits_for_grid(general_tiles_bound(min(2, k), 1, block_q) * num_kv_heads, span(k), NUM_SMS,
                                      MIN_KEYS_PER_GENERAL_SPLIT, MAX_GENERAL_SPLITS) for k in lengths if k >= 2}
            assert warmed == reachable, (block_q, window)


def test_the_largest_counts_need_long_keys():
    """The ladder tops out where the most splits are reached, and stops at max_len."""
    assert split_warm_up_lengths(40960)[-1] == MAX_SPLITS * MIN_TOKENS_PER_SPLIT
    assert split_warm_up_lengths(4096) == [256, 512, 1024, 2048, 4096]
    assert split_warm_up_lengths(300) == [256, 300]
