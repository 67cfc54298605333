"""Whether each engine replica's routing stats are current: the Router's own evidence that a
replica is still there, without waiting for Ray to declare its node dead.

Serve's controller pulls every replica's `record_routing_stats` once per stats period and
broadcasts what changed; each pull carries the replica's `ts`, so a live replica's `ts` changes
every period. The Router notes, on its own clock, when it first saw each `ts` (every broadcast
reaches `KVQueueRequestRouter.update_replicas`; `rank` notes the candidates it is given too).
`ts` itself is never compared with the Router's clock: node clocks may disagree.

A replica whose `ts` has not changed for `stale_after_s` has stopped reporting (its node is
lost, its process hangs, or its pulls time out) and is not picked while some other replica's
stats are current. When every candidate is stale (the controller or the whole cluster is slow,
or no stats have come yet) they all stay candidates: staleness never refuses every replica.
A stale replica whose next stats arrive is a candidate again at once.

The window, in stats periods: the controller starts a pull period x U(0.9, 1.1) after the
previous one, at its next visit of the replica (its sweep takes up to half a period), and the
result is broadcast at a control tick (0.1 s) after it returns: consecutive arrivals are at most
~1.6 periods + 0.1 s apart in normal operation (routing_sim.py's serve_stats_timing models this).
STALE_PERIODS = 3 plus STALE_SLACK_S leaves more than a period for a slow pull or a busy
controller before a live replica is set aside, and sets a lost one aside ~3 periods after it
last reported, well before Ray's node health checks (by default 5 missed checks of 3 s).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

STALE_PERIODS = 3
STALE_SLACK_S = 0.25


def stale_after_s(stats_period_s: float) -> float:
    """How long without new stats sets a replica aside, for this stats period."""
    return STALE_PERIODS * stats_period_s + STALE_SLACK_S


class StatsFreshness:
    """Per replica: the `ts` of its latest stats and when this Router first saw it."""

    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._seen: dict[Any, tuple[Any, float]] = {}  # replica -> (ts, when first seen); ts None: no stats yet
        self.set_aside: set = set()  # replicas left out of the last ranking that saw them, for the log

    def note(self, replica, now: float) -> float:
        """When the replica's current stats (or, before any, the replica) were first seen."""
        stats = replica.routing_stats
        ts = stats.get("ts") if stats else None
        seen = self._seen.get(replica.replica_id)
        if seen is None or seen[0] != ts:
            seen = self._seen[replica.replica_id] = (ts, now)
            if replica.replica_id in self.set_aside and ts is not None:
                self.set_aside.discard(replica.replica_id)
                logger.info("replica %s reports routing stats again: routing to it", replica.replica_id)
        return seen[1]

    def current(self, candidates: list, now: float) -> list:
        """`candidates` less those whose stats are stale, unless that would leave none (then
        `candidates` itself). Allocates only when some are left out."""
        limit = now - self.stale_after_s
        stale = 0
        for replica in candidates:
            if self.note(replica, now) < limit:
                stale += 1
        if stale == 0 or stale == len(candidates):
            return candidates
        kept = []
        for replica in candidates:
            seen_at = self._seen[replica.replica_id][1]
            if seen_at >= limit:
                kept.append(replica)
            elif replica.replica_id not in self.set_aside:
                self.set_aside.add(replica.replica_id)
                logger.warning("replica %s sent no routing stats for %.2f s (more than %.2f s): not routing to it "
                               "while others report", replica.replica_id, now - seen_at, self.stale_after_s)
        return kept

    def forget(self, live_replica_ids: set) -> None:
        for replica_id in [r for r in self._seen if r not in live_replica_ids]:
            del self._seen[replica_id]
        self.set_aside &= live_replica_ids
