"""Which engine replica serves a request: roseray's Ray Serve RequestRouter.

Signals, per replica:
  * `routing_stats` from the engine's `record_routing_stats` (pushed by Serve every
    `request_routing_stats_period_s`): queue depth, free/total KV blocks, and `ts`, the
    replica's clock when the snapshot was taken;
  * this router's own picks since that snapshot. The HAProxy ingress router picks with
    `choose_replica(_reserve=False)`, so nothing else tells it about requests it sent
    after the last snapshot; without counting them every request of a burst would land
    on the same replica (herding). A pick still counts until a snapshot taken
    `pick_grace_s` after it: a request needs a moment to travel from the pick through
    HAProxy to the replica, and a snapshot taken meanwhile does not contain it yet.

Ranking (`policy="kv_queue"`): replicas whose (estimated) free blocks can hold the request
first, then the shortest queue, then the most free blocks, ties broken at random. Prefix
affinity: the router remembers which replica it sent each prompt block-hash chain to; a
request whose longest known prefix lives on a replica goes there, unless that replica's
queue is more than `affinity_max_imbalance` above the shortest (the load gate) or it
cannot hold it.

`policy="cache_aware"`: the free-KV gate first, then the least cost (cache_aware.py): the
prompt blocks still to prefill at the replica, by its exact cache contents, plus its load;
then the most free blocks, the KV its running requests do not hold (as in kv_queue: with
nothing cached anywhere it ranks as kv_queue).
The contents come from the replicas' KV cache events (`"kv"` in their routing stats:
kv_event_feed.py), which every policy feeds into `kv_index` (a KVCacheIndex), each stats
dict once (by its `ts`); a replica that leaves is forgotten. At each cache_aware pick the age
of its view of the chosen replica (KVCacheIndex.content_age; None: it has none) goes to
`on_view_age`: the Router's RequestRouter passes its process's router_metrics.

Given `stats_period_s` (the app passes it), a replica whose stats stopped coming is not
picked while others' are current (stats_freshness.py).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch
from roseray.ray_serve import router_metrics
from roseray.ray_serve.cache_aware import CacheAwareWeights, common_prefix
from roseray.ray_serve.json_head import loads_or_head
from roseray.ray_serve.kv_index import KVCacheIndex
from roseray.ray_serve.stats_freshness import StatsFreshness, stale_after_s


@dataclass(frozen=True)
class RoutingHint:
    """What the router knows of a request before it is sent."""

    need_blocks: int = 1  # KV blocks the request needs (estimated)
    prefix_hashes: tuple[int, ...] = ()  # block-hash chain of the prompt, shortest prefix first
    prompt_blocks: int = 0  # the prompt's blocks (cache_aware: the engine's chain is its full ones)

    @classmethod
    def from_route_arg(cls, arg: Any) -> RoutingHint | None:
        """The hint passed to choose_replica, by its fields: Serve ships this module's
        RequestRouter by value, so in the router its RoutingHint is another class object
        than the caller's and isinstance() cannot be used."""
        need_blocks, prefix_hashes = getattr(arg, "need_blocks", None), getattr(arg, "prefix_hashes", None)
        prompt_blocks = getattr(arg, "prompt_blocks", 0)
        if not isinstance(need_blocks, int) or not isinstance(prefix_hashes, tuple) or not isinstance(prompt_blocks,
                                                                                                        int):
            return None
        return cls(need_blocks, prefix_hashes, prompt_blocks)


@dataclass(frozen=True)
class HintConfig:
    block_size: int = 16
    chars_per_token: float = 4.0  # prompt text -> token estimate (1.0 for the byte tokenizer)
    affinity_block_chars: int = 256  # text per affinity hash block
    max_affinity_blocks: int = 64


def _chain(parts: Iterable[bytes]) -> tuple[int, ...]:
    hashes, parent = [], b""
    for part in parts:
        digest = hashlib.blake2b(parent + part, digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        parent = digest
    return tuple(hashes)


def hint_from_body(body: bytes, session_id: str | None, config: HintConfig,
                   truncated: str | None = None) -> RoutingHint:
    """A RoutingHint from the (possibly truncated) OpenAI body HAProxy forwarded, or from
    a session id; the default hint when neither says anything.

    `truncated`: HAProxy's X-Body-Truncated header ("<forwarded>/<full>" bytes) when the body
    was longer than its buffer: the JSON is then closed where it was cut (the prompt's head
    still gives the affinity chain) and the prompt-size estimate is scaled to the full body."""
    data, parsed = loads_or_head(body)
    if not isinstance(data, dict):
        data = {}
    raw, size, prompt_tokens = _prompt_bytes(data, config)
    scale = _truncation_scale(truncated, parsed, len(body))
    if scale > 1.0:
        prompt_tokens = math.ceil(prompt_tokens * scale)
    max_tokens = next((data[key] for key in ("max_completion_tokens", "max_tokens")
                       if isinstance(data.get(key), int) and data[key] > 0), 0)
    prefix_hashes: tuple[int, ...] = ()
    if session_id:
        prefix_hashes = _chain([b"session:" + session_id.encode()])
    elif raw:
        blocks = [raw[i:i + size] for i in range(0, len(raw) - size + 1, size)][: config.max_affinity_blocks]
        prefix_hashes = _chain(blocks)
    need_blocks = max(1, math.ceil((prompt_tokens + max_tokens) / config.block_size))
    return RoutingHint(need_blocks=need_blocks, prefix_hashes=prefix_hashes)


def _truncation_scale(header: str | None, parsed: int, received: int) -> float:
    """The full body's size (X-Body-Truncated: "<forwarded>/<full>", else what arrived) over
    the bytes the hint was read from; 1.0 when all of it was read."""
    full = received
    if header:
        try:
            full = max(received, int(header.partition("/")[2]))
        except ValueError:
            pass
    return max(1.0, full / parsed) if parsed > 0 else 1.0


def _prompt_bytes(data: dict, config: HintConfig) -> tuple[bytes, int, int]:
    """(prompt as bytes, bytes per affinity block, estimated prompt tokens)."""
    if isinstance(data.get("messages"), list):
        text = "".join(f"<{m.get('role', '')}>{_content_text(m.get('content'))}"
                       for m in data["messages"] if isinstance(m, dict))
        return text.encode(), config.affinity_block_chars, math.ceil(len(text) / config.chars_per_token)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt.encode(), config.affinity_block_chars, math.ceil(len(prompt) / config.chars_per_token)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):  # token ids: 64 per block
        return b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in prompt), 256, len(prompt)
    return b"", 1, 0


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


@dataclass
class _Picks:
    """This router's picks of one replica not yet visible in its routing stats."""

    seen_ts: float | None = None
    picks: collections.deque = field(default_factory=collections.deque)  # (time.time(), need_blocks)


class RoutingPolicy:
    """The ranking, free of Ray: candidates are anything with `replica_id` and `routing_stats`."""

    def __init__(self, *, affinity_max_imbalance: int = 4, affinity_capacity: int = 100_000,
                 pick_grace_s: float = 0.2, unseen_pick_window_s: float = 2.0, seed: int | None = None,
                 policy: str = "kv_queue", prefill_weight: float = 1.0, load_weight: float | None = None,
                 pick_cache_s: float = 2.0, stats_period_s: float | None = None,
                 on_view_age: Callable[[float | None], None] | None = None) -> None:
        if policy not in ("kv_queue", "cache_aware"):
            raise ValueError(f"policy must be kv_queue or cache_aware, got {policy!r}")
        self.cache_aware = CacheAwareWeights(prefill_weight, load_weight) if policy == "cache_aware" else None
        self.kv_index = KVCacheIndex()
        self.on_view_age = on_view_age
        self._kv_seen_ts: dict[Any, Any] = {}  # replica -> the `ts` of the last stats dict fed to kv_index
        self._kv_snapshot_applied: dict[Any, tuple[int, int]] = {}  # replica -> (epoch, seq) of its last snapshot
        self.pick_cache_s = pick_cache_s
        self._picked_chains: dict[Any, collections.deque] = {}  # replica -> (time, chain) of recent picks
        self._best_cached: tuple[tuple[int, ...], int] = ((), 0)  # the last ranking's chain, most blocks held
        self.affinity_max_imbalance = affinity_max_imbalance
        self.pick_grace_s = pick_grace_s
        self.affinity_capacity = affinity_capacity
        self.unseen_pick_window_s = unseen_pick_window_s
        self._picks: dict[Any, _Picks] = {}
        self._affinity: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._rng = random.Random(seed)
        self.freshness = StatsFreshness(stale_after_s(stats_period_s)) if stats_period_s else None

    def _pending(self, replica_id, stats: dict, now: float) -> tuple[int, int]:
        """(picks, blocks) sent to this replica after its latest snapshot was taken."""
        entry = self._picks.setdefault(replica_id, _Picks())
        ts = stats.get("ts")
        picks = entry.picks
        if ts is not None:
            if ts != entry.seen_ts:
                entry.seen_ts = ts
                while picks and picks[0][0] <= ts - self.pick_grace_s:
                    picks.popleft()
        else:  # no snapshot yet: count recent picks only
            while picks and picks[0][0] < now - self.unseen_pick_window_s:
                picks.popleft()
        return len(picks), sum(blocks for _, blocks in picks)

    def observe(self, replica) -> None:
        """Feed the replica's recent KV event batches and snapshots (kv_event_feed.py) into
        `kv_index`, once per stats dict: those it has not applied yet, in order."""
        stats = replica.routing_stats or {}
        kv, ts, replica_id = stats.get("kv"), stats.get("ts"), replica.replica_id
        if not isinstance(kv, dict) or ts is None or self._kv_seen_ts.get(replica_id) == ts:
            return
        self._kv_seen_ts[replica_id] = ts
        index = self.kv_index
        for entry in kv.get("recent", ()):
            if "snapshot" in entry:
                snapshot = KVCacheSnapshot.from_dict(entry["snapshot"])
                key = (snapshot.epoch, snapshot.seq)
                if index.needs_snapshot(replica_id) or (not index.covers(replica_id, *key)
                                                        and self._kv_snapshot_applied.get(replica_id) != key):
                    index.apply_snapshot(replica_id, snapshot, as_of=ts)
                    self._kv_snapshot_applied[replica_id] = key
            elif "batch" in entry:
                index.apply(replica_id, KVEventBatch.from_dict(entry["batch"]), as_of=ts)  # one applied: skipped

    def cached_blocks(self, replica_id, chain: tuple[int, ...], now: float) -> int:
        """The leading blocks of `chain` the replica holds (its events), or will hold (this
        router's picks sent there in the last `pick_cache_s`: a request's blocks reach the
        replica's events only once it has been prefilled and the next stats came)."""
        cached = self.kv_index.longest_cached_prefix(replica_id, chain)
        picked = self._picked_chains.get(replica_id)
        if picked:
            while picked and picked[0][0] < now - self.pick_cache_s:
                picked.popleft()
            for _, picked_chain in picked:
                cached = max(cached, common_prefix(chain, picked_chain))
        return cached

    def _load(self, replica, now: float) -> tuple[int, int | None]:
        """(its queue, its free KV blocks; None: no stats yet), both counting this router's picks
        sent there since its latest stats."""
        stats = replica.routing_stats or {}
        num_picks, picked_blocks = self._pending(replica.replica_id, stats, now)
        kv_free = stats.get("kv_free")
        return int(stats.get("queue", 0)) + num_picks, None if kv_free is None else int(kv_free) - picked_blocks

    def score(self, replica, hint: RoutingHint, now: float) -> tuple[int, int, int]:
        queue, free = self._load(replica, now)
        if free is None:  # no stats yet: assume it fits
            return 0, queue, 0
        return (0 if free >= hint.need_blocks else 1), queue, -free

    def cache_aware_score(self, replica, hint: RoutingHint, now: float) -> tuple[tuple[int, float, int], int]:
        """((0 if it can hold the request else 1, its cost: cache_aware.py, minus its free blocks),
        the blocks of the request's prefix it holds). The gate counts the blocks the request needs
        beyond that prefix (this router's picks' too: requests sharing a prefix share its blocks).
        Free blocks break equal costs as in kv_queue: without them a no-sharing load, where every
        cost is the same prompt plus the queue, spread its ties at random and fell behind
        kv_queue's TTFT (BENCHMARKS.md)."""
        queue, free = self._load(replica, now)
        chain = hint.prefix_hashes
        cached = self.cached_blocks(replica.replica_id, chain, now)
        fits = free is None or free >= hint.need_blocks - cached
        cost = self.cache_aware.cost(max(hint.prompt_blocks, len(chain)) - cached, queue)
        return ((0 if fits else 1), cost, -(free or 0)), cached

    def rank(self, candidates: list, hint: RoutingHint | None = None, now: float | None = None) -> list:
        hint = hint or RoutingHint()
        now = time.time() if now is None else now
        if self.freshness is not None:
            candidates = self.freshness.current(candidates, now)
        for replica in candidates:
            self.observe(replica)
        if self.cache_aware is not None:
            costed, best = [], 0
            for replica in candidates:
                score, cached = self.cache_aware_score(replica, hint, now)
                best = max(best, cached)
                costed.append((score, self._rng.random(), replica))
            self._best_cached = (hint.prefix_hashes, best)  # for this request's record_pick
            costed.sort(key=lambda item: (item[0], item[1]))
            return [r for _, _, r in costed]
        scored = [(self.score(r, hint, now), self._rng.random(), r) for r in candidates]
        scored.sort(key=lambda item: (item[0], item[1]))
        ranked = [r for _, _, r in scored]
        target = self._affinity_target(hint, scored)
        if target is not None:
            ranked.remove(target)
            ranked.insert(0, target)
        return ranked

    def _affinity_target(self, hint: RoutingHint, scored: list):
        if not hint.prefix_hashes or not scored:
            return None
        by_id = {r.replica_id: (score, r) for score, _, r in scored}
        shortest_queue = min(score[1] for score, _, _ in scored if score[0] == scored[0][0][0])
        for prefix_hash in reversed(hint.prefix_hashes):  # longest known prefix first
            replica_id = self._affinity.get(prefix_hash)
            if replica_id is None or replica_id not in by_id:
                continue
            (fits, queue, _), replica = by_id[replica_id]
            if fits == 0 and queue <= shortest_queue + self.affinity_max_imbalance:
                return replica
            return None  # the prefix's replica is too busy or too full: balance instead
        return None

    def record_pick(self, replica_id, hint: RoutingHint | None = None, now: float | None = None) -> None:
        hint = hint or RoutingHint()
        now = time.time() if now is None else now
        if self.cache_aware is not None:
            chain = hint.prefix_hashes
            cached = self.cached_blocks(replica_id, chain, now)
            self._picks.setdefault(replica_id, _Picks()).picks.append((now, max(0, hint.need_blocks - cached)))
            # the load weight learns what a request needs to prefill at best (on the replica that
            # holds most of its prefix), not where it went: a router that sent requests away from
            # their prefix would otherwise raise its own load weight and send more away. The best
            # is the one its ranking found (the same chain object), else looked up again.
            ranked_chain, best = self._best_cached
            if ranked_chain is not chain:
                best = max((self.cached_blocks(r, chain, now)
                            for r in itertools.chain(self.kv_index.replicas(), self._picked_chains)), default=0)
            self.cache_aware.observe(max(hint.prompt_blocks, len(chain)) - max(best, cached))
            if chain:
                self._picked_chains.setdefault(replica_id, collections.deque()).append((now, chain))
            if self.on_view_age is not None:
                self.on_view_age(self.kv_index.content_age(replica_id, now))
            return
        self._picks.setdefault(replica_id, _Picks()).picks.append((now, hint.need_blocks))
        affinity = self._affinity
        for prefix_hash in hint.prefix_hashes:
            affinity[prefix_hash] = replica_id
            affinity.move_to_end(prefix_hash)
        while len(affinity) > self.affinity_capacity:
            affinity.popitem(last=False)

    def note_stats(self, replicas: Iterable, now: float) -> None:
        """The replicas' stats as they arrive (stats_freshness.py)."""
        if self.freshness is not None:
            for replica in replicas:
                self.freshness.note(replica, now)

    def forget(self, live_replica_ids: set) -> None:
        if self.freshness is not None:
            self.freshness.forget(live_replica_ids)
        for replica_id in [r for r in self._picks if r not in live_replica_ids]:
            del self._picks[replica_id]
        for replica_id in [r for r in self.kv_index.replicas() if r not in live_replica_ids]:
            self.kv_index.forget(replica_id)
        for table in (self._kv_seen_ts, self._kv_snapshot_applied, self._picked_chains):
            for replica_id in [r for r in table if r not in live_replica_ids]:
                del table[replica_id]


class KVQueueRequestRouter(FIFOMixin, RequestRouter):
    """roseray's Serve RequestRouter: RoutingPolicy over the engine replicas.

    The RoutingHint travels as the first positional argument of `choose_replica`.
    Returns one replica per rank, so Serve tries the next only if the first refuses.
    """

    def initialize_state(self, **kwargs) -> None:
        # the module, not its object: Serve ships this class by value, and the process's metrics
        # are the ones the Router replica's HTTP app serves
        kwargs.setdefault("on_view_age", router_metrics.ROUTER_METRICS.observe_view_age)
        self.policy = RoutingPolicy(**kwargs)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not hasattr(self, "policy"):
            self.initialize_state()
        hint = None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
            if pending_request.args:
                hint = RoutingHint.from_route_arg(pending_request.args[0])
        ranked = self.policy.rank(candidate_replicas, hint)
        if ranked and pending_request is not None:
            self.policy.record_pick(ranked[0].replica_id, hint)
        return [[replica] for replica in ranked]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if hasattr(self, "policy"):
            self.policy.forget({r.replica_id for r in replicas})
            self.policy.note_stats(replicas, time.time())
