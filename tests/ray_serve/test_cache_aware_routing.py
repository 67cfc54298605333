"""The cache_aware routing policy (no Ray cluster): KV event batches and snapshots in the
replicas' routing stats feed the Router's index once per stats dict; a replica holding a
request's prefix wins while its extra load costs less than the prefill it saves; the free-KV
gate comes first; a restarted replica (new epoch) or one whose events were lost stops
attracting the prefix; replicas that leave are forgotten; the Router's prompt chain
(PromptChainer: the engine's tokenizer, the API's body -> token ids) is the engine's own."""

import asyncio
import json
import random
from dataclasses import dataclass, field

import pytest

from roseray.config import EngineConfig
from roseray.engine.block_hash import block_chain
from roseray.engine.engine import LLMEngine
from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch
from roseray.openai_api.prompt_ids import prompt_ids
from roseray.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from roseray.ray_serve.cache_aware import CacheAwareWeights
from roseray.ray_serve.prompt_chain import PromptChainer
from roseray.ray_serve.router_metrics import RouterMetrics
from roseray.ray_serve.routing import HintConfig, KVQueueRequestRouter, RoutingHint, RoutingPolicy
from roseray.sampling_params import SamplingParams

BLOCK = 16
CHAIN = tuple(block_chain(list(range(300, 300 + 20 * BLOCK)), BLOCK))  # a 20-block prefix
HINT = RoutingHint(need_blocks=23, prefix_hashes=CHAIN, prompt_blocks=21)


@dataclass
class Replica:
    replica_id: str
    routing_stats: dict = field(default_factory=dict)


def stats(queue=0, kv_free=100, ts=1000.0, kv=None):
    values = {"queue": queue, "kv_free": kv_free, "kv_total": 100, "ts": ts}
    if kv is not None:
        values["kv"] = kv if "recent" in kv else recent(kv)
    return values


def batch(seq, stored=(), epoch=7, **kwargs):
    """One batch entry of a replica's `kv` (kv_event_feed.py)."""
    return {"batch": KVEventBatch(epoch, seq, tuple(stored), (), **kwargs).to_dict()}


def snapshot(seq, hashes, epoch=7):
    return {"snapshot": KVCacheSnapshot(epoch, seq, tuple(hashes)).to_dict()}


def recent(*entries):
    return {"recent": list(entries)}


def policy(load_weight=2.0):
    return RoutingPolicy(policy="cache_aware", load_weight=load_weight, seed=0)


def holder_and_other(holder_queue, other_queue=0, kv_free=100):
    return (Replica("holder", stats(holder_queue, kv_free=kv_free, kv=batch(1, CHAIN))),
            Replica("other", stats(other_queue, kv=batch(1))))


def test_the_replica_holding_a_long_prefix_wins_while_its_queue_costs_less_than_the_prefill_it_saves():
    # holder: 1 block to prefill + 2 per request; other: 21 blocks + 2 per request
    for holder_queue, winner in [(0, "holder"), (5, "holder"), (9, "holder"), (11, "other")]:
        assert policy().rank(list(holder_and_other(holder_queue)), HINT, now=1000.5)[0].replica_id == winner
    # the other's own queue counts as well
    assert policy().rank(list(holder_and_other(14, other_queue=5)), HINT, now=1000.5)[0].replica_id == "holder"


def test_the_free_kv_gate_comes_first():
    ranked = policy().rank(list(holder_and_other(0, kv_free=2)), HINT, now=1000.5)
    assert ranked[0].replica_id == "other"


def test_the_gate_counts_only_the_blocks_beyond_the_cached_prefix():
    # 23 blocks needed, 20 of them cached at the holder: 10 free blocks hold the rest
    assert policy().rank(list(holder_and_other(0, kv_free=10)), HINT, now=1000.5)[0].replica_id == "holder"
    # a burst sharing the prefix shares its blocks: each pick takes 3 new blocks, not 23
    p = policy(load_weight=0.5)
    holder, other = holder_and_other(0, kv_free=30)
    for _ in range(5):
        first = p.rank([holder, other], HINT, now=1000.5)[0]
        p.record_pick(first.replica_id, HINT, now=1000.5)
        assert first is holder


def test_with_nothing_cached_anywhere_it_ranks_as_kv_queue():
    """No sharing: every cost is the same prompt plus the queue, so the order is kv_queue's
    (shortest queue, then most free blocks), for random queues and free blocks."""
    def order(ranked):  # kv_queue's keys of a ranking (replicas equal in them may come in any order)
        return [(s["kv_free"] < 23, s["queue"], -s["kv_free"]) for s in (r.routing_stats for r in ranked)]

    rng = random.Random(3)
    hint = RoutingHint(need_blocks=23, prefix_hashes=CHAIN, prompt_blocks=21)  # its blocks held nowhere
    for trial in range(50):
        replicas = [Replica(f"r{i}", stats(rng.randint(0, 3), kv_free=rng.choice([10, 40, 60, 80, 100]), kv=batch(1)))
                    for i in range(6)]
        want = RoutingPolicy(seed=trial).rank(replicas, RoutingHint(need_blocks=23), now=1000.5)
        assert order(policy().rank(replicas, hint, now=1000.5)) == order(want)


def test_a_restarted_replica_stops_attracting_the_prefix():
    p = policy()
    holder, other = holder_and_other(1)
    assert p.rank([holder, other], HINT, now=1000.5)[0] is holder
    holder.routing_stats = stats(1, ts=1001.0, kv=batch(1, epoch=8))  # a new engine: its cache is empty
    assert p.rank([holder, other], HINT, now=1001.5)[0] is other


def test_the_index_dates_its_view_by_the_stats_that_carried_it():
    """The age of the Router's view of a replica's cache (KVCacheIndex.content_age) runs from the
    `ts` of the routing-stats dict whose batch or snapshot it applied: the replica's clock."""
    p = policy()
    holder, other = holder_and_other(1)
    p.rank([holder, other], HINT, now=1000.4)
    assert p.kv_index.content_age("holder", 1000.4) == pytest.approx(0.4)
    holder.routing_stats = stats(1, ts=1000.5, kv=recent(batch(1, CHAIN), batch(2)))
    other.routing_stats = stats(0, ts=1000.6, kv=snapshot(3, ()))
    p.rank([holder, other], HINT, now=1000.9)
    assert p.kv_index.content_age("holder", 1000.9) == pytest.approx(0.4)
    assert p.kv_index.content_age("other", 1000.9) == pytest.approx(0.3)


def view_age_metrics(metrics: RouterMetrics) -> dict[str, float]:
    """The exposition's samples of the view-age histogram and the missing-view counter."""
    samples = {}
    for family in metrics.collect():
        for sample in family.samples:
            samples[sample.name + (f"le={sample.labels['le']}" if "le" in sample.labels else "")] = sample.value
    return samples


def test_each_cache_aware_pick_records_the_age_of_its_view_of_the_chosen_replica():
    """At a pick the Router observes KVCacheIndex.content_age of the chosen replica at the
    pick's time (`now`: the test's clock), or counts a pick without a usable view."""
    metrics = RouterMetrics("m")
    p = RoutingPolicy(policy="cache_aware", load_weight=2.0, seed=0, on_view_age=metrics.observe_view_age)
    holder, other = holder_and_other(0)  # stats of ts 1000.0
    for now in (1000.25, 1000.65, 1003.0):
        chosen = p.rank([holder, other], HINT, now=now)[0]
        assert chosen is holder
        p.record_pick(chosen.replica_id, HINT, now=now)
    stranger = Replica("stranger", stats(ts=1003.0))  # no KV events yet: no view
    p.record_pick(p.rank([stranger], HINT, now=1003.1)[0].replica_id, HINT, now=1003.1)
    samples = view_age_metrics(metrics)
    assert samples["roseray:router_kv_view_age_seconds_count"] == 3
    assert samples["roseray:router_kv_view_age_seconds_sum"] == pytest.approx(0.25 + 0.65 + 3.0)
    assert samples["roseray:router_kv_view_age_seconds_bucketle=0.2"] == 0
    assert samples["roseray:router_kv_view_age_seconds_bucketle=0.3"] == 1
    assert samples["roseray:router_kv_view_age_seconds_bucketle=0.6"] == 1
    assert samples["roseray:router_kv_view_age_seconds_bucketle=0.7"] == 2
    assert samples["roseray:router_kv_view_age_seconds_bucketle=2.5"] == 2
    assert samples["roseray:router_kv_view_age_seconds_bucketle=+Inf"] == 3
    assert samples["roseray:router_kv_view_missing_total"] == 1
    assert b'roseray:router_kv_view_age_seconds_count{model_name="m"} 3.0' in metrics.render()


def test_kv_queue_picks_record_no_view_age():
    metrics = RouterMetrics()
    p = RoutingPolicy(policy="kv_queue", seed=0, on_view_age=metrics.observe_view_age)
    holder, other = holder_and_other(0)
    p.record_pick(p.rank([holder, other], HINT, now=1000.5)[0].replica_id, HINT, now=1000.5)
    samples = view_age_metrics(metrics)
    assert samples["roseray:router_kv_view_age_seconds_count"] == 0
    assert samples["roseray:router_kv_view_missing_total"] == 0


def test_a_lost_batch_makes_the_view_stale_until_a_snapshot():
    p = policy()
    holder, other = holder_and_other(1)
    p.rank([holder, other], HINT, now=1000.5)
    holder.routing_stats = stats(1, ts=1001.0, kv=batch(3))  # batch 2 never arrived
    assert p.rank([holder, other], HINT, now=1001.5)[0] is other
    assert p.kv_index.needs_snapshot("holder")
    holder.routing_stats = stats(1, ts=1002.0, kv=snapshot(4, CHAIN))
    assert p.rank([holder, other], HINT, now=1002.5)[0] is holder


def test_stats_dicts_missed_are_made_up_by_the_window_of_recent_entries():
    p = policy()
    holder, other = Replica("holder", stats(1, kv=batch(1))), Replica("other", stats(0, kv=batch(1)))
    p.rank([holder, other], HINT, now=1000.5)
    # the Router missed the dicts of batches 2 and 3 (the prefix was stored in 2); this one has 2..4
    holder.routing_stats = stats(1, ts=1001.0, kv=recent(batch(2, CHAIN), batch(3), batch(4)))
    assert p.rank([holder, other], HINT, now=1001.5)[0] is holder
    assert not p.kv_index.needs_snapshot("holder")
    # a snapshot in the window is applied only when the view is behind it (a snapshot taken
    # after batch 3 is older than the view after batch 4)
    holder.routing_stats = stats(1, ts=1002.0, kv=recent(batch(4), snapshot(3, ()), batch(5)))
    assert p.rank([holder, other], HINT, now=1002.5)[0] is holder
    holder.routing_stats = stats(1, ts=1003.0, kv=recent(snapshot(9, ()), batch(10)))
    assert p.rank([holder, other], HINT, now=1003.5)[0] is other


def test_each_stats_dict_is_applied_once():
    p = policy()
    holder, other = holder_and_other(0)
    p.rank([holder, other], HINT, now=1000.5)
    p.kv_index.forget("holder")  # were the same dict applied again, batch 1 would rebuild the view
    p.rank([holder, other], HINT, now=1000.6)
    assert p.kv_index.longest_cached_prefix("holder", CHAIN) == 0


def test_picks_since_the_last_stats_count_as_cached_so_a_burst_of_one_prefix_stays_together():
    p = RoutingPolicy(policy="cache_aware", seed=1)  # the adaptive load weight
    a, b = Replica("a", stats(kv=batch(1))), Replica("b", stats(kv=batch(1)))
    picks = []
    for _ in range(4):
        first = p.rank([a, b], HINT, now=1000.5)[0]
        p.record_pick(first.replica_id, HINT, now=1000.5)
        picks.append(first.replica_id)
    assert len(set(picks)) == 1
    # the mean blocks prefilled fell towards the 1 block each follower had left to prefill
    assert p.cache_aware.load() < 2.0
    # after pick_cache_s (2 s) the picks no longer count as cached: the events alone would tell
    assert p.cached_blocks(picks[0], CHAIN, now=1000.5) == 20
    assert p.cached_blocks(picks[0], CHAIN, now=1003.0) == 0


def test_a_snapshot_taken_after_the_last_batch_holds_the_events_since():
    p = policy()
    holder, other = Replica("holder", stats(1, kv=batch(1))), Replica("other", stats(0, kv=batch(1)))
    p.rank([holder, other], HINT, now=1000.5)
    # the safety-net snapshot after batch 1: it holds what was stored since (batch 2 will repeat it)
    holder.routing_stats = stats(1, ts=1001.0, kv=recent(batch(1), snapshot(1, CHAIN)))
    assert p.rank([holder, other], HINT, now=1001.5)[0] is holder


def test_adaptive_load_weight_is_the_mean_of_blocks_prefilled():
    weights = CacheAwareWeights()
    for _ in range(200):
        weights.observe(30)
    assert weights.load() == pytest.approx(30, rel=0.01)
    assert CacheAwareWeights(load_weight=3.0).load() == 3.0


def test_the_adaptive_load_weight_learns_the_prefill_a_request_needs_at_best_not_where_it_went():
    # every pick goes to the replica without the prefix (as an overloaded holder would force): the
    # mean must stay at the 1 block left to prefill on the holder, not climb to the 21 prefilled
    p = RoutingPolicy(policy="cache_aware", seed=0)
    holder, other = holder_and_other(0)
    p.rank([holder, other], HINT, now=1000.5)  # the Router's index learns both replicas' caches
    for i in range(200):
        p.record_pick("other", RoutingHint(need_blocks=23, prefix_hashes=CHAIN, prompt_blocks=21), now=1000.5 + i)
    assert p.cache_aware.load() == pytest.approx(1.0)
    # requests no replica holds any of (each its own prompt) need their whole prompt: the mean follows
    for i in range(200):
        fresh = tuple(block_chain([10_000 + i] * (20 * BLOCK), BLOCK))
        p.record_pick("other", RoutingHint(need_blocks=23, prefix_hashes=fresh, prompt_blocks=21), now=2000.0 + i)
    assert p.cache_aware.load() == pytest.approx(21, rel=0.01)


def test_replicas_that_leave_are_forgotten_by_the_serve_router():
    router = KVQueueRequestRouter.__new__(KVQueueRequestRouter)  # the policy part, without a Serve runtime
    router.initialize_state(policy="cache_aware")
    holder, other = holder_and_other(0)
    asyncio.run(router.choose_replicas([holder, other], None))
    assert set(router.policy.kv_index.replicas()) == {"holder", "other"}
    router.policy.forget({"other"})
    assert router.policy.kv_index.replicas() == ["other"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        RoutingPolicy(policy="round_robin")


# ---- the Router's chain is the engine's ---------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=64, max_model_len=512,
                                  max_num_seqs=4, block_size=BLOCK))


def chainer(engine):
    return PromptChainer(engine.tokenizer, HintConfig(block_size=BLOCK, chars_per_token=1.0))


def serve(engine, token_ids):
    engine.add_request("r", token_ids, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


CHAT = {"model": "m", "messages": [{"role": "system", "content": "You are terse. " * 12},
                                   {"role": "user", "content": "Summarise: " + "lorem ipsum " * 20}],
        "max_tokens": 8}


@pytest.mark.parametrize("body, request_class", [
    (CHAT, ChatCompletionRequest),
    ({"model": "m", "prompt": "the shared preamble " * 15, "max_tokens": 4}, CompletionRequest),
    ({"model": "m", "prompt": list(range(260, 400))}, CompletionRequest),
])
def test_the_routers_chain_matches_the_engines_events(engine, body, request_class):
    engine.drain_kv_events()
    token_ids, _ = prompt_ids(request_class.model_validate(body), engine.tokenizer)
    serve(engine, token_ids)
    events = engine.drain_kv_events()
    hint = chainer(engine).hint(json.dumps(body).encode())
    assert len(hint.prefix_hashes) == len(token_ids) // BLOCK > 0
    assert set(hint.prefix_hashes) <= set(events.stored) | set(engine.kv_cache_snapshot().hashes)
    assert hint.prompt_blocks == -(-len(token_ids) // BLOCK)
    # routed on those events, the request goes to the replica that served it
    p = policy()
    served = Replica("served", stats(2, kv={"snapshot": engine.kv_cache_snapshot().to_dict()}))  # its last dict
    fresh = Replica("fresh", stats(0, kv=batch(1)))
    assert p.rank([fresh, served], hint, now=1000.5)[0] is served


def test_a_cut_body_gives_the_head_of_the_full_chain(engine):
    full_body = json.dumps(CHAT).encode()
    full = chainer(engine).hint(full_body)
    cut = chainer(engine).hint(full_body[:300], truncated=f"300/{len(full_body)}")
    assert 0 < len(cut.prefix_hashes) < len(full.prefix_hashes)
    assert cut.prefix_hashes == full.prefix_hashes[:len(cut.prefix_hashes)]
    # the size estimate is scaled to the full body (bytes, not tokens: roughly)
    assert len(cut.prefix_hashes) + 2 < cut.prompt_blocks
    assert cut.prompt_blocks == pytest.approx(full.prompt_blocks, rel=0.2)


def test_an_unreadable_body_gets_a_size_estimate_and_no_chain(engine):
    hint = chainer(engine).hint(b'{"model": "m", "max_tokens": 40}')
    assert hint.prefix_hashes == () and hint.need_blocks >= 1
    assert chainer(engine).hint(b"not json").prefix_hashes == ()


def test_chains_are_cached_by_the_prompt(engine):
    c = chainer(engine)
    body = dict(CHAT)
    first = c.hint(json.dumps(body).encode())
    body["max_tokens"] = 99  # not a prompt field: the same chain, from the cache
    assert c.hint(json.dumps(body).encode()).prefix_hashes == first.prefix_hashes and len(c._cache) == 1
