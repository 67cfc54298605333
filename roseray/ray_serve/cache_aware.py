"""The `cache_aware` routing policy's cost: work a request adds at each replica, from the
replica's exact prefix cache contents (kv_index.py) and its load.

    cost = prefill_weight * (prompt blocks still to prefill there) + load_weight * (requests there)

"Prompt blocks still to prefill" is the request's prompt blocks minus the longest prefix of
its chain the replica holds (as its KV events say, or as this router's picks sent there in
the last `pick_cache_s` suggest: those blocks are cached once the pick is prefilled, and
reach the events a stats period or two later). "Requests there" is the replica's queue
(running + waiting, from its stats) plus this router's picks since them.

The weights, in units of one prompt block's prefill:
  * prefill_weight = 1: the unit;
  * load_weight: what one request already at the replica costs the new one. A request ahead
    in the queue delays it by about one prefill of its own, and that prefill is only its
    uncached part: so by default load_weight is the running mean (EWMA, floor 1 block) of
    the blocks the requests this router routed had still to prefill at best, on the replica
    holding most of their prefix. (Not where they went: under overload, queues differ by more
    than that mean allows, requests go where their prefix is not, the mean grows, and more go
    astray; in the routing simulator at 1.5x power-of-two's saturating load that spiral took
    the prefix-cache hit rate from ~90% to ~75% and the throughput with it.) With
    long shared prefixes that mean is small, and a replica holding a request's prefix keeps
    it while its queue is up to about (blocks it saves) / (mean blocks prefilled) longer
    than another's; with unshared prompts it is one prompt, and load balances as kv_queue
    does. A number fixes it (a running request's decode steps cost less than a queued
    prefill; the mean over-counts them, which errs towards balance).
The free-KV gate ranks first (replicas that can hold the request before those that
cannot, as kv_queue does); equal costs go to the replica with the most free KV blocks (the
least KV held by running requests: decode load the queue does not show), as in kv_queue, and
remaining ties at random.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class CacheAwareWeights:
    prefill_weight: float = 1.0  # per prompt block still to prefill
    load_weight: float | None = None  # per request at the replica; None: the mean blocks prefilled (EWMA)
    mean_decay: float = 0.05  # the EWMA's weight of each new request
    mean_prefill_blocks: float = 1.0  # the EWMA (its start: one block)

    def observe(self, prefill_blocks: int) -> None:
        """Fold the blocks one routed request had still to prefill at best into the mean."""
        self.mean_prefill_blocks += self.mean_decay * (max(1, prefill_blocks) - self.mean_prefill_blocks)

    def load(self) -> float:
        return self.mean_prefill_blocks if self.load_weight is None else self.load_weight

    def cost(self, to_prefill: int, requests: int) -> float:
        return self.prefill_weight * to_prefill + self.load() * requests


def common_prefix(chain: Sequence[int], other: Sequence[int]) -> int:
    """How many leading hashes two chains share."""
    count = 0
    for a, b in zip(chain, other):
        if a != b:
            break
        count += 1
    return count
