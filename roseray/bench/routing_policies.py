"""The routing simulator's policies: which replica gets a request.

A replica is anything with `replica_id`, `routing_stats` (the snapshot Serve last pulled:
queue, kv_free, ts; refreshed by the simulator every stats period), `num_active` (its
true number of requests now) and `block_manager` (its real prefix cache).

- random: uniform.
- power_of_two: two distinct random replicas, the one with fewer requests now (Ray Serve's
  PowerOfTwoChoicesRequestRouter keeps queue lengths fresh through its reservations' replies).
- kv_queue: roseray.ray_serve.routing.RoutingPolicy's ranking (free-KV gate, queue from the
  stats snapshot + this router's picks since, most free blocks) without prefix hashes.
- approximate: the same RoutingPolicy with prefix affinity from the block-hash chain
  `hint_from_body` makes of a token-id prompt (blake2b over 64-token blocks, at most 64 of
  them): today's roseray router (the app's `kv_queue` policy sees request bodies).
- exact: per replica, the prompt blocks it would still have to prefill, read from its
  BlockManager's actual prefix cache (the longest cached run of the request's block chain),
  turned into seconds by the step-time model, plus its queue (snapshot + picks, as
  RoutingPolicy counts it) x `queue_delay_s`; behind RoutingPolicy's free-KV gate; ties go
  to the most free blocks (as RoutingPolicy's), then at random. `queue_delay_s`, what one
  more request ahead costs a newcomer, defaults to the prefill of `queue_tokens` = 512
  uncached tokens after a 6k prefix (~6 ms with the provisional model): a tenant's cached
  6k prefix (~52 ms to prefill) outweighs ~9 requests of queue: RoutingPolicy's
  affinity_max_imbalance (4) made graded instead of a cut-off.
- cache_aware: the Router's real `cache_aware` policy (RoutingPolicy(policy="cache_aware"),
  cache_aware.py) on the engine's block chain of the prompt (as PromptChainer makes it),
  its KVCacheIndex fed by the replicas' real KV event feeds in their routing stats (the
  simulator sends them: `wants_kv_events`). Unlike exact it sees each cache as of the
  replica's last stats: it measures that view at every pick (`measurements`): the age of
  the contents it shows for each replica (KVCacheIndex.content_age) and how often its
  count of the request's cached leading blocks on the chosen one is above the truth
  (blocks evicted since) or below it (cached since).
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from dataclasses import dataclass

import numpy as np

from roseray.bench.routing_step_time import StepTimeModel
from roseray.engine.block_hash import block_chain
from roseray.ray_serve.routing import RoutingHint, RoutingPolicy

AFFINITY_TOKENS_PER_BLOCK = 64  # hint_from_body: 256 bytes of 4-byte token ids
MAX_AFFINITY_BLOCKS = 64  # HintConfig.max_affinity_blocks


def token_affinity_chain(prompt_ids: list[int]) -> tuple[int, ...]:
    """What `hint_from_body` computes for a body whose prompt is these token ids."""
    raw = b"".join((t & 0xFFFFFFFF).to_bytes(4, "little")
                   for t in prompt_ids[: AFFINITY_TOKENS_PER_BLOCK * MAX_AFFINITY_BLOCKS])
    size = 4 * AFFINITY_TOKENS_PER_BLOCK
    hashes, parent = [], b""
    for i in range(0, len(raw) - size + 1, size):
        digest = hashlib.blake2b(parent + raw[i:i + size], digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        parent = digest
    return tuple(hashes)


@dataclass
class RouteRequest:
    """What a policy may look at: the prompt's token ids and its size in KV blocks."""

    prompt_ids: list[int]
    max_tokens: int
    block_size: int

    @property
    def need_blocks(self) -> int:
        return max(1, math.ceil((len(self.prompt_ids) + self.max_tokens) / self.block_size))


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int = 0, **_) -> None:
        self._rng = random.Random(seed)

    def choose(self, replicas: list, request: RouteRequest, now: float):
        return self._rng.choice(replicas)


class PowerOfTwoPolicy:
    name = "power_of_two"

    def __init__(self, seed: int = 0, **_) -> None:
        self._rng = random.Random(seed)

    def choose(self, replicas: list, request: RouteRequest, now: float):
        if len(replicas) < 2:
            return replicas[0]
        a, b = self._rng.sample(replicas, 2)
        return a if a.num_active <= b.num_active else b


class KVQueuePolicy:
    """RoutingPolicy's rank and record_pick, as KVQueueRequestRouter calls them."""

    name = "kv_queue"
    affinity = False

    def __init__(self, seed: int = 0, affinity_max_imbalance: int = 4, **_) -> None:
        self.policy = RoutingPolicy(affinity_max_imbalance=affinity_max_imbalance, seed=seed)

    def choose(self, replicas: list, request: RouteRequest, now: float):
        prefix = token_affinity_chain(request.prompt_ids) if self.affinity else ()
        hint = RoutingHint(need_blocks=request.need_blocks, prefix_hashes=prefix)
        chosen = self.policy.rank(replicas, hint, now=now)[0]
        self.policy.record_pick(chosen.replica_id, hint, now=now)
        return chosen


class ApproximatePolicy(KVQueuePolicy):
    name = "approximate"
    affinity = True


class ExactPolicy:
    name = "exact"

    def __init__(self, seed: int = 0, model: StepTimeModel | None = None, queue_tokens: int = 512,
                 queue_prefix_tokens: int = 6000, **_) -> None:
        self.model = model or StepTimeModel()
        self.queue_delay_s = self.model.prefill_seconds(queue_tokens, queue_prefix_tokens)
        self.load = RoutingPolicy(seed=seed)  # its free-KV gate and queue count (snapshot + picks)
        self._rng = random.Random(seed)

    def cost(self, replica, request: RouteRequest, chain: list[int], now: float) -> tuple[int, float, int]:
        """(0 if the replica can hold the request else 1, estimated seconds before its first
        token, minus its estimated free blocks: RoutingPolicy's last criterion)."""
        fits, queue, neg_free = self.load.score(replica, RoutingHint(need_blocks=request.need_blocks), now)
        size = request.block_size
        cached = replica.block_manager.num_cached_prefix_blocks(chain) * size
        prefill = self.model.prefill_seconds(len(request.prompt_ids) - cached, cached)
        return fits, prefill + queue * self.queue_delay_s, neg_free

    def choose(self, replicas: list, request: RouteRequest, now: float):
        size = request.block_size
        chain = block_chain(request.prompt_ids[: (len(request.prompt_ids) - 1) // size * size], size)
        scored = [(self.cost(r, request, chain, now), self._rng.random(), r) for r in replicas]
        chosen = min(scored, key=lambda item: (item[0], item[1]))[2]
        self.load.record_pick(chosen.replica_id, RoutingHint(need_blocks=request.need_blocks), now=now)
        return chosen


class CacheAwarePolicy:
    name = "cache_aware"
    wants_kv_events = True

    def __init__(self, seed: int = 0, **_) -> None:
        self.policy = RoutingPolicy(policy="cache_aware", seed=seed)
        self.view_ages = array("d")  # per pick, per replica: the age of its view (content_age)
        self.picks = self.no_view = self.over = self.under = 0

    def choose(self, replicas: list, request: RouteRequest, now: float):
        size = request.block_size
        chain = tuple(block_chain(request.prompt_ids, size))
        hint = RoutingHint(need_blocks=request.need_blocks, prefix_hashes=chain,
                           prompt_blocks=math.ceil(len(request.prompt_ids) / size))
        chosen = self.policy.rank(replicas, hint, now=now)[0]
        self.policy.record_pick(chosen.replica_id, hint, now=now)
        self._measure(replicas, chosen, chain, now)
        return chosen

    def _measure(self, replicas: list, chosen, chain: tuple[int, ...], now: float) -> None:
        """The view of every replica as this pick ranked them, and its error on the chosen one."""
        index = self.policy.kv_index
        self.picks += 1
        for replica in replicas:
            age = index.content_age(replica.replica_id, now)
            if age is None:
                self.no_view += 1
            else:
                self.view_ages.append(age)
        seen = index.longest_cached_prefix(chosen.replica_id, chain)
        truth = chosen.block_manager.num_cached_prefix_blocks(list(chain))
        self.over += seen > truth
        self.under += seen < truth

    def measurements(self) -> dict:
        """The age of the views the picks ranked on (p50/p99/max over every replica at every
        pick, seconds), the share of those with no usable view (not heard from yet, or stale
        waiting for a snapshot), and how often the chosen replica's view counted more or fewer
        of the request's leading blocks than it held."""
        ages = np.frombuffer(self.view_ages, dtype=np.float64) if len(self.view_ages) else np.full(1, np.nan)
        picks = max(1, self.picks)
        return {"view_age_p50_s": float(np.percentile(ages, 50)), "view_age_p99_s": float(np.percentile(ages, 99)),
                "view_age_max_s": float(np.max(ages)),
                "view_missing_rate": self.no_view / max(1, self.no_view + len(self.view_ages)),
                "view_over_rate": self.over / picks, "view_under_rate": self.under / picks}


POLICIES = {p.name: p for p in (RandomPolicy, PowerOfTwoPolicy, KVQueuePolicy, ApproximatePolicy, ExactPolicy,
                                CacheAwarePolicy)}
