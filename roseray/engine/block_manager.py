"""Array-backed KV block manager with a prefix cache on full blocks.

One block id spans all layers. Per-block state lives in numpy arrays indexed by block
id (ref counts, hashes); free blocks are an int stack; freed blocks that still hold a
cached prefix wait in an insertion-ordered dict (oldest first = LRU) until a hit takes
them back or an allocation evicts them. Block tables of all running requests live in
one preallocated int32 array `[max_num_seqs, max_blocks_per_seq]`, one row per request,
whose memory is shared with a (pinned, when CUDA is present) torch tensor.

A full block's hash chains its parent's hash and its own token ids (block_hash.py: stable
across processes), so equal hashes mean equal prefixes. Only full blocks are shared: a
shared block is never written. Each live request's block hashes are kept here by request
id (they outlive a preemption: the tokens stay the same) until the request finishes
(`release`). Once a consumer enables them, every hash entering or leaving the prefix cache
is reported to a KVEventLog (kv_events.py) for the Router's index.
"""

from __future__ import annotations

import numpy as np
import torch

from roseray.engine.block_hash import extend_chain
from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch, KVEventLog
from roseray.engine.request import Request


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.enable_prefix_caching = enable_prefix_caching

        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.block_hashes = np.zeros(num_blocks, dtype=np.int64)
        self.is_cached = np.zeros(num_blocks, dtype=bool)  # block_hashes[b] is valid
        self._hash_to_block: dict[int, int] = {}
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack, pops low ids first
        self._evictable: dict[int, None] = {}  # free but cached blocks, least recently freed first
        self._request_hashes: dict[str, list[int]] = {}  # request id -> hashes of its full blocks, in order

        pin = torch.cuda.is_available()
        # [max_num_seqs, max_blocks_per_seq]; the numpy view shares the tensor's memory.
        self.block_tables_tensor = torch.zeros((max_num_seqs, max_blocks_per_seq), dtype=torch.int32, pin_memory=pin)
        self.block_tables = self.block_tables_tensor.numpy()
        self._free_rows: list[int] = list(range(max_num_seqs - 1, -1, -1))

        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found cached
        # A slow consumer's backlog beyond twice the cache's blocks costs more than a snapshot.
        self.kv_events = KVEventLog(max_pending=2 * num_blocks)
        self._events: KVEventLog | None = None  # self.kv_events once a consumer enabled it

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- admission and growth -----------------------------------------------------
    def allocate_prefix(self, req: Request, num_new_tokens: int) -> bool:
        """Admit a waiting request: take its cached prefix blocks and enough new blocks
        for its first `num_new_tokens` uncached tokens. Returns False (changing nothing)
        when the free blocks do not suffice. Sets `req.num_computed_tokens` to the hit length.
        """
        if self.blocks_needed(req.num_tokens) > self.max_blocks_per_seq:
            raise ValueError(f"{req.request_id} has {req.num_tokens} tokens, more than a block table holds "
                             f"({self.max_blocks_per_seq} blocks of {self.block_size})")
        hit_blocks = self._match_prefix(req)
        num_hit_tokens = len(hit_blocks) * self.block_size
        num_new_tokens = min(num_new_tokens, req.num_tokens - num_hit_tokens)
        needed = self.blocks_needed(num_hit_tokens + num_new_tokens) - len(hit_blocks)
        reclaimed = sum(1 for b in hit_blocks if self.ref_counts[b] == 0)  # hits that sit in the free pool
        if needed > self.num_free_blocks - reclaimed or not self._free_rows:
            return False

        if req.num_preemptions == 0:
            self.prefix_cache_queries += req.num_prompt_tokens
            self.prefix_cache_hits += num_hit_tokens
            req.num_cached_tokens = num_hit_tokens
        req.row = self._free_rows.pop()
        row = self.block_tables[req.row]
        for i, block in enumerate(hit_blocks):
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1
            row[i] = block
        req.num_blocks = len(hit_blocks)
        req.num_committed_blocks = len(hit_blocks)
        req.num_computed_tokens = num_hit_tokens
        self._grow(req, needed)
        return True

    def append_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of a running request (False if the
        free blocks do not suffice; nothing is allocated then)."""
        needed = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - req.num_blocks
        if needed <= 0:
            return True
        if req.num_blocks + needed > self.max_blocks_per_seq:
            raise ValueError(f"{req.request_id} would exceed max_blocks_per_seq={self.max_blocks_per_seq}")
        if needed > self.num_free_blocks:
            return False
        self._grow(req, needed)
        return True

    def free(self, req: Request) -> None:
        """Release a request's blocks (finish, abort or preemption) and its table row.
        Tail blocks are released first so that they are evicted before the shared head."""
        if req.row < 0:
            return
        blocks = self.block_tables[req.row, : req.num_blocks]
        for block in blocks[::-1].tolist():
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.is_cached[block]:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        self._free_rows.append(req.row)
        req.row = -1
        req.num_blocks = 0
        req.num_committed_blocks = 0

    def release(self, req: Request) -> None:
        """The request is finished: free its blocks and forget its block hashes."""
        self.free(req)
        self._request_hashes.pop(req.request_id, None)

    def request_hashes(self, req: Request) -> list[int]:
        """The hashes of the request's full blocks computed so far, in order."""
        hashes = self._request_hashes.get(req.request_id)
        if hashes is None:
            hashes = self._request_hashes[req.request_id] = []
        return hashes

    def commit_full_blocks(self, req: Request, num_known_tokens: int | None = None) -> None:
        """Hash the blocks that are full of computed tokens and publish them in the prefix
        cache; `num_known_tokens` caps them to the tokens whose ids the host knows."""
        num_full = req.num_computed_tokens
        if num_known_tokens is not None:
            num_full = min(num_full, num_known_tokens)
        num_full //= self.block_size
        if not self.enable_prefix_caching or num_full <= req.num_committed_blocks or req.row < 0:
            return
        hashes = self._extend_hashes(req, num_full)
        row = self.block_tables[req.row]
        for i in range(req.num_committed_blocks, num_full):
            block, block_hash = int(row[i]), hashes[i]
            if not self.is_cached[block] and block_hash not in self._hash_to_block:
                self.is_cached[block] = True
                self.block_hashes[block] = block_hash
                self._hash_to_block[block_hash] = block
                if self._events is not None:
                    self._events.stored(block_hash)
        req.num_committed_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Unpublish every cached block: free ones return to the free stack, blocks in use stay
        with their requests (and are not published again: their requests' committed blocks
        stay committed)."""
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        self._hash_to_block.clear()
        self.is_cached[:] = False
        if self._events is not None:
            self._events.cleared()

    # ---- KV cache events (the Router's index) -------------------------------------------
    def drain_kv_events(self) -> KVEventBatch:
        """The prefix cache's changes since the last drain (recording starts with the first call)."""
        self._enable_kv_events()
        return self._events.drain()

    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """Every cached chain hash, for a consumer that lost events (or starts late)."""
        self._enable_kv_events()
        return self._events.snapshot(list(self._hash_to_block))

    def _enable_kv_events(self) -> None:
        if self._events is None:
            self.kv_events.enable(cache_empty=not self._hash_to_block)
            self._events = self.kv_events

    def num_cached_prefix_blocks(self, chain: list[int]) -> int:
        """How many leading blocks of a block-hash chain (`block_chain`) the prefix cache holds
        now: what a request with that chain would not have to prefill here."""
        cached = self._hash_to_block
        for i, block_hash in enumerate(chain):
            if block_hash not in cached:
                return i
        return len(chain)

    # ---- internals --------------------------------------------------------------------
    def _match_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens. At least one token is
        always left to compute, so the last prompt token is never served from cache."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._extend_hashes(req, max_blocks)
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self._hash_to_block.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _extend_hashes(self, req: Request, num_blocks: int) -> list[int]:
        """The request's block hashes, extended to at least `num_blocks` full blocks."""
        return extend_chain(self.request_hashes(req), req.token_ids, self.block_size, num_blocks)

    def _grow(self, req: Request, count: int) -> None:
        row = self.block_tables[req.row]
        for i in range(req.num_blocks, req.num_blocks + count):
            row[i] = self._take_free_block()
        req.num_blocks += count

    def _take_free_block(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently freed cached block
            block = next(iter(self._evictable))
            del self._evictable[block]
            block_hash = int(self.block_hashes[block])
            del self._hash_to_block[block_hash]
            self.is_cached[block] = False
            if self._events is not None:
                self._events.removed(block_hash)
        self.ref_counts[block] = 1
        return block

    # ---- checks -------------------------------------------------------------------------
    def check_integrity(self, live_requests: list[Request]) -> None:
        """Assert that the block accounting is consistent with the live requests."""
        expected = np.zeros(self.num_blocks, dtype=np.int32)
        rows = [req.row for req in live_requests if req.row >= 0]
        assert len(rows) == len(set(rows)), "two requests share a block-table row"
        for req in live_requests:
            if req.row >= 0:
                np.add.at(expected, self.block_tables[req.row, : req.num_blocks], 1)
        assert np.array_equal(expected, self.ref_counts), "ref counts disagree with the block tables"
        free, evictable = set(self._free), set(self._evictable)
        used = set(np.flatnonzero(self.ref_counts).tolist())
        assert len(free) == len(self._free), "a block is twice on the free stack"
        assert not (free & evictable) and not (free & used) and not (evictable & used), "block in two pools"
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "blocks leaked"
        assert all(self.is_cached[b] for b in evictable), "an uncached block waits in the evictable pool"
        assert not any(self.is_cached[b] for b in free), "a cached block sits on the free stack"
        cached = set(np.flatnonzero(self.is_cached).tolist())
        assert cached == set(self._hash_to_block.values()), "hash map disagrees with cached blocks"
        assert all(self.block_hashes[b] == h for h, b in self._hash_to_block.items()), "stale hash"
        assert len(self._free_rows) + len(rows) == self.block_tables.shape[0], "block-table rows leaked"
        live_ids = {req.request_id for req in live_requests}
        assert set(self._request_hashes) <= live_ids, "block hashes kept for a finished request"
