"""roseray's routing policy (no Ray cluster): ranking by KV fit and queue depth, counting
its own picks between stats snapshots, random ties, prefix affinity behind a load gate,
routing hints from request bodies."""

import asyncio
import collections
import json
import logging
from dataclasses import dataclass, field

import pytest

from roseray.ray_serve.routing import HintConfig, KVQueueRequestRouter, RoutingHint, RoutingPolicy, hint_from_body


@dataclass
class Replica:
    replica_id: str
    routing_stats: dict = field(default_factory=dict)


def stats(queue=0, kv_free=100, ts=1000.0):
    return {"queue": queue, "kv_free": kv_free, "kv_total": 100, "ts": ts}


def test_shortest_queue_first_then_most_free_blocks():
    policy = RoutingPolicy(seed=0)
    a, b, c = Replica("a", stats(queue=3)), Replica("b", stats(queue=1, kv_free=50)), Replica("c", stats(queue=1))
    assert [r.replica_id for r in policy.rank([a, b, c], now=1000.5)] == ["c", "b", "a"]


def test_a_replica_that_cannot_hold_the_request_is_ranked_last():
    policy = RoutingPolicy(seed=0)
    full = Replica("full", stats(queue=0, kv_free=3))
    busy = Replica("busy", stats(queue=5, kv_free=90))
    assert policy.rank([full, busy], RoutingHint(need_blocks=10), now=1000.5)[0] is busy
    # a small request still fits the nearly full replica, which has the shorter queue
    assert policy.rank([full, busy], RoutingHint(need_blocks=2), now=1000.5)[0] is full


def test_own_picks_count_until_the_next_snapshot_so_a_burst_spreads():
    policy = RoutingPolicy(seed=0)
    replicas = [Replica("a", stats(ts=1000.0)), Replica("b", stats(ts=1000.0))]
    counts = collections.Counter()
    for i in range(10):  # a burst: no new stats arrive in between
        best = policy.rank(replicas, now=1000.1 + i * 0.001)[0]
        policy.record_pick(best.replica_id, now=1000.1 + i * 0.001)
        counts[best.replica_id] += 1
    assert counts == {"a": 5, "b": 5}


def test_without_pick_counting_a_burst_would_herd():
    """The control for the test above: ranking on stale stats alone sends every request
    of the burst to the same replica."""
    policy = RoutingPolicy(seed=0)
    replicas = [Replica("a", stats(ts=1000.0)), Replica("b", stats(ts=1000.0, queue=1))]
    picks = {policy.rank(replicas, now=1000.1)[0].replica_id for _ in range(10)}  # never record_pick
    assert picks == {"a"}


def test_picks_older_than_a_new_snapshot_are_dropped():
    policy = RoutingPolicy(seed=0)
    a, b = Replica("a", stats(ts=1000.0)), Replica("b", stats(ts=1000.0, queue=1))
    for t in (1000.1, 1000.3, 1000.35):
        policy.record_pick("a", now=t)
    assert policy.rank([a, b], now=1000.4)[0] is b  # a: 0 + 3 picks > b: 1
    # a snapshot 0.15 s after the last two picks: they may still be on their way to a
    a.routing_stats = stats(ts=1000.45, queue=0)
    assert policy.rank([a, b], now=1000.5)[0] is b  # a: 0 + 2 picks > b: 1
    a.routing_stats = stats(ts=1000.6, queue=0)  # taken well after every pick: they are in it (or done)
    assert policy.rank([a, b], now=1000.7)[0] is a


def test_picked_blocks_count_against_free_blocks():
    policy = RoutingPolicy(seed=0)
    a, b = Replica("a", stats(kv_free=30)), Replica("b", stats(kv_free=30, queue=5))
    hint = RoutingHint(need_blocks=20)
    assert policy.rank([a, b], hint, now=1000.1)[0] is a
    policy.record_pick("a", hint, now=1000.1)
    policy.record_pick("a", RoutingHint(), now=1000.1)
    policy.record_pick("a", RoutingHint(), now=1000.1)
    # a has the shorter queue (0 + 3 picks < 5), but 30 - 22 picked blocks < 20 needed
    assert policy.rank([a, b], hint, now=1000.2)[0] is b


def test_ties_are_broken_at_random():
    policy = RoutingPolicy(seed=1)
    replicas = [Replica(name, stats()) for name in "abcd"]
    firsts = {policy.rank(replicas, now=1000.1)[0].replica_id for _ in range(200)}
    assert firsts == set("abcd")


def test_prefix_affinity_follows_the_longest_known_prefix_within_the_load_gate():
    policy = RoutingPolicy(affinity_max_imbalance=2, seed=0)
    a, b = Replica("a", stats(queue=0)), Replica("b", stats(queue=1))
    shared = RoutingHint(prefix_hashes=(11, 12, 13))
    policy.record_pick("b", shared, now=999.0)  # before the snapshot: not counted as pending
    follow_up = RoutingHint(prefix_hashes=(11, 12, 13, 14))
    assert policy.rank([a, b], follow_up, now=1000.1)[0] is b  # a has the shorter queue, b has the prefix
    b.routing_stats = stats(queue=3)  # past the gate (0 + 2)
    assert policy.rank([a, b], follow_up, now=1000.1)[0] is a
    b.routing_stats = stats(queue=1, kv_free=0)  # cannot hold it
    assert policy.rank([a, b], follow_up, now=1000.1)[0] is a


def test_affinity_to_a_replica_that_left_is_ignored():
    policy = RoutingPolicy(seed=0)
    policy.record_pick("gone", RoutingHint(prefix_hashes=(1, 2)), now=999.0)
    a, b = Replica("a", stats(queue=1)), Replica("b", stats(queue=0))
    assert policy.rank([a, b], RoutingHint(prefix_hashes=(1, 2)), now=1000.1)[0] is b


def test_hint_from_body_estimates_blocks_and_chains_prefixes():
    config = HintConfig(block_size=16, chars_per_token=1.0, affinity_block_chars=8)
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 60}).encode()
    hint = hint_from_body(body, None, config)
    assert hint.need_blocks == -(-(len("<user>") + 100 + 60) // 16)
    longer = json.dumps({"messages": [{"role": "user", "content": "x" * 100 + "more"}]}).encode()
    other = json.dumps({"messages": [{"role": "user", "content": "y" * 100}]}).encode()
    # same prefix, same chain; a different prompt shares nothing
    assert hint_from_body(longer, None, config).prefix_hashes[: len(hint.prefix_hashes)] == hint.prefix_hashes
    assert not set(hint_from_body(other, None, config).prefix_hashes) & set(hint.prefix_hashes)
    completion = hint_from_body(json.dumps({"prompt": "z" * 40}).encode(), None, config)
    assert completion.need_blocks == 3 and len(completion.prefix_hashes) == 5
    token_ids = hint_from_body(json.dumps({"prompt": list(range(1, 201)), "max_tokens": 40}).encode(), None, config)
    assert token_ids.need_blocks == 15 and len(token_ids.prefix_hashes) == 3  # 240 tokens; 64 ids per block
    assert hint_from_body(json.dumps({"prompt": [list(range(1, 201))], "max_tokens": 40}).encode(), None,
                          config) == token_ids


def test_hint_without_a_body_or_with_a_session():
    config = HintConfig()
    assert hint_from_body(b"", None, config) == RoutingHint()
    assert hint_from_body(b'{"messages": [{"ro', None, config) == RoutingHint()  # cut by HAProxy before the prompt
    session = hint_from_body(b"", "user-42", config)
    assert len(session.prefix_hashes) == 1 and session == hint_from_body(b"", "user-42", config)


class _Context:
    should_backoff = False


@dataclass
class _Pending:
    args: list
    routing_context: _Context = field(default_factory=_Context)


@dataclass(frozen=True)
class ForeignHint:
    """What a RoutingHint looks like inside Serve's router: a by-value copy of the class."""

    need_blocks: int
    prefix_hashes: tuple = ()


@pytest.mark.parametrize("hint", [None, RoutingHint(need_blocks=50), ForeignHint(need_blocks=50)])
def test_the_serve_router_ranks_singletons_and_records_its_pick(hint):
    router = KVQueueRequestRouter.__new__(KVQueueRequestRouter)  # the policy part, without a Serve runtime
    router.initialize_state(affinity_max_imbalance=4)
    small, big = Replica("small", stats(kv_free=10)), Replica("big", stats(kv_free=90, queue=1))
    ranks = asyncio.run(router.choose_replicas([small, big], _Pending(args=[hint] if hint else [])))
    assert all(len(rank) == 1 for rank in ranks)
    expected = "big" if hint else "small"
    assert ranks[0][0].replica_id == expected
    assert len(router.policy._picks[expected].picks) == 1


@pytest.mark.parametrize("data", [
    {"prompt": 'a\\b"c\u00e9\u1234d' * 30, "max_tokens": 5},
    {"prompt": list(range(1000, 1300)), "max_tokens": 3},
    {"prompt": [list(range(7, 200))], "stream": True},
    {"model": "m", "messages": [{"role": "user", "content": "x\u00e9y\n" * 40}], "max_tokens": 60},
])
def test_hint_from_a_cut_body_keeps_the_prompts_head(data):
    """HAProxy forwards at most its buffer (RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE) of a
    body, marked X-Body-Truncated: wherever the cut falls, the hint's chain is a prefix of the
    whole body's chain (affinity still finds the shared head) and never invalid JSON's default."""
    config = HintConfig(block_size=16, chars_per_token=1.0, affinity_block_chars=8)
    body = json.dumps(data).encode()
    whole = hint_from_body(body, None, config)
    heads = []
    for cut in range(1, len(body)):
        hint = hint_from_body(body[:cut], None, config, f"{cut}/{len(body)}")
        assert hint.prefix_hashes == whole.prefix_hashes[: len(hint.prefix_hashes)], cut
        heads.append(len(hint.prefix_hashes))
    assert heads[-1] >= len(whole.prefix_hashes) - 1 and heads[len(body) // 2] > 0


def test_hint_from_a_cut_body_scales_the_prompt_estimate():
    config = HintConfig(block_size=16, chars_per_token=1.0)
    body = json.dumps({"prompt": "q" * 4000}).encode()
    whole = hint_from_body(body, None, config)
    half = hint_from_body(body[: len(body) // 2], None, config, f"{len(body) // 2}/{len(body)}")
    assert abs(half.need_blocks - whole.need_blocks) <= 1  # ~2000 characters seen, scaled by 2
    unmarked = hint_from_body(body[: len(body) // 2], None, config)  # no header: what arrived is all
    assert unmarked.need_blocks <= whole.need_blocks // 2 + 1
    assert hint_from_body(body[:100], None, config, "100/oops").need_blocks == 6  # 89 characters, unscaled


def test_a_replica_whose_stats_stopped_coming_is_not_picked_while_others_report(caplog):
    """stats_freshness.py: with a 0.25 s stats period a replica is set aside 3 x 0.25 + 0.25 = 1 s after its
    latest stats arrived (the Router's clock, not the stats' `ts`), only while another's stats are current,
    and is picked again as soon as it reports."""
    caplog.set_level(logging.INFO, logger="roseray.ray_serve.stats_freshness")
    policy = RoutingPolicy(seed=0, stats_period_s=0.25)
    assert policy.freshness.stale_after_s == pytest.approx(1.0)
    idle, busy = Replica("idle", stats(queue=0, ts=5.0)), Replica("busy", stats(queue=3, ts=7.0))
    ids = lambda ranked: [r.replica_id for r in ranked]  # noqa: E731
    policy.note_stats([idle, busy], now=100.0)  # a broadcast: both arrive (their ts: other clocks, never compared)
    assert ids(policy.rank([idle, busy], now=100.9)) == ["idle", "busy"]
    busy.routing_stats = stats(queue=3, ts=7.3)  # busy reports again; idle does not
    policy.note_stats([idle, busy], now=100.5)
    assert ids(policy.rank([idle, busy], now=100.99)) == ["idle", "busy"]  # idle's stats are 0.99 s old
    assert ids(policy.rank([idle, busy], now=101.01)) == ["busy"]  # 1.01 s: set aside
    assert ids(policy.rank([busy, idle], now=101.3)) == ["busy"]
    assert [r.levelname for r in caplog.records if "idle" in r.getMessage()] == ["WARNING"]  # said once
    # every replica stale (the controller is slow, say): ranked as without the rule, never refused
    assert ids(policy.rank([idle, busy], now=102.0)) == ["idle", "busy"]
    # idle reports again: a candidate at once, and ranked first (shorter queue)
    idle.routing_stats = stats(queue=0, ts=6.1)
    assert ids(policy.rank([idle, busy], now=102.01)) == ["idle"]  # busy: last arrival 100.5, stale
    busy.routing_stats = stats(queue=3, ts=8.9)
    assert ids(policy.rank([idle, busy], now=102.02)) == ["idle", "busy"]
    assert "idle reports routing stats again" in caplog.text
    # a replica that never reported counts from when it was first seen
    new = Replica("new", {})
    assert sorted(ids(policy.rank([new, idle, busy], now=102.5))) == ["busy", "idle", "new"]
    idle.routing_stats, busy.routing_stats = stats(queue=0, ts=6.5), stats(queue=3, ts=9.3)
    policy.note_stats([new, idle, busy], now=103.4)
    assert ids(policy.rank([new, idle, busy], now=103.6)) == ["idle", "busy"]  # new: 1.1 s and no stats
    policy.forget({"idle", "busy"})
    assert policy.freshness.set_aside == set()


def test_stats_arrival_is_dated_when_it_arrives_not_at_the_next_ranking():
    """Sparse traffic: stats noted as the broadcast brings them (update_replicas), so the first ranking after
    a quiet spell still knows how long ago a replica last reported."""
    policy = RoutingPolicy(seed=0, stats_period_s=0.5)  # set aside after 1.75 s
    lost, live = Replica("lost", stats(queue=0, ts=1.0)), Replica("live", stats(queue=2, ts=1.0))
    policy.note_stats([lost, live], now=10.0)
    for t in (10.5, 11.0, 11.5, 12.0):  # only live keeps reporting; nothing is routed meanwhile
        live.routing_stats = stats(queue=2, ts=t)
        policy.note_stats([lost, live], now=t)
    assert [r.replica_id for r in policy.rank([lost, live], now=12.1)] == ["live"]
    assert [r.replica_id for r in RoutingPolicy(seed=0).rank([lost, live], now=12.1)] == ["lost", "live"]  # no rule
