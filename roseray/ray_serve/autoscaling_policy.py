"""How many Engine replicas the engines' own load asks for: Ray Serve's custom autoscaling policy.

With HAProxy streaming straight from a replica's port, Serve's ongoing-request counts (its default
policy's input) miss the streams; the engines know their load. Each replica reports it through
`record_autoscaling_stats` (ENGINE_LOAD_METRICS, `engine_load_stats`); Serve averages each metric
over `look_back_period_s` per replica and calls `EngineLoadPolicy` with them on every control loop.

The policy only says how many replicas the load needs. Serve applies the rest: min/max bounds, and
upscale_delay_s / downscale_delay_s (a decision takes effect only once it has held that long).

Ray-free on purpose: Serve pickles this module by value into its controller, and the unit tests
call `desired_replicas` without a cluster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The metrics each Engine replica reports (record_autoscaling_stats) and this policy reads.
REQUESTS_METRIC = "engine_requests"  # running + waiting requests in the engine (streams included)
KV_USAGE_METRIC = "engine_kv_usage"  # fraction of the replica's KV blocks in use, 0..1
ENGINE_LOAD_METRICS = (REQUESTS_METRIC, KV_USAGE_METRIC)


def engine_load_stats(num_running: int, num_waiting: int, num_active: int, num_free_blocks: int,
                      num_total_blocks: int) -> dict[str, float]:
    """One replica's load as record_autoscaling_stats returns it. `num_active`: requests the engine
    has accepted (some not in its scheduler yet); the larger of it and running + waiting counts."""
    used = num_total_blocks - num_free_blocks
    return {REQUESTS_METRIC: float(max(num_running + num_waiting, num_active)),
            KV_USAGE_METRIC: used / num_total_blocks if num_total_blocks else 0.0}


@dataclass(frozen=True)
class ReplicaLoad:
    """One running replica's load, averaged over Serve's look-back window."""

    requests: float  # running + waiting
    kv_usage: float  # 0..1


def desired_replicas(loads: list[ReplicaLoad], current: int, target_requests: float,
                     target_kv_usage: float) -> int:
    """Replicas for the load: enough that each carries at most `target_requests` requests and at
    most `target_kv_usage` of its KV cache, the larger of the two counts; at least 1.

    `loads`: the replicas that reported (a replica that has not yet reported adds nothing: it
    is starting, or just started). No report at all: keep `current`, since nothing is known."""
    if not loads:
        return current
    by_requests = math.ceil(sum(load.requests for load in loads) / target_requests - 1e-9)
    by_kv = math.ceil(sum(load.kv_usage for load in loads) / target_kv_usage - 1e-9)
    return max(1, by_requests, by_kv)


def loads_from_metrics(aggregated: Mapping[str, Mapping[Any, float]] | None) -> list[ReplicaLoad]:
    """ReplicaLoads from Serve's aggregated custom metrics ({metric: {replica id: value}})."""
    if not aggregated:
        return []
    requests = aggregated.get(REQUESTS_METRIC, {})
    kv_usage = aggregated.get(KV_USAGE_METRIC, {})
    return [ReplicaLoad(requests=float(requests[replica]), kv_usage=float(kv_usage.get(replica, 0.0)))
            for replica in requests]


class EngineLoadPolicy:
    """Serve's `AutoscalingPolicy(policy_function=EngineLoadPolicy, policy_kwargs=...)`: Serve
    builds one per deployment and calls it with an AutoscalingContext on each control loop."""

    def __init__(self, target_requests_per_replica: float, target_kv_usage: float) -> None:
        if target_requests_per_replica <= 0 or not 0 < target_kv_usage <= 1:
            raise ValueError("target_requests_per_replica must be > 0 and target_kv_usage in (0, 1]")
        self.target_requests = target_requests_per_replica
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """(replicas the load asks for, the policy state: nothing of ours, Serve keeps its own keys)."""
        loads = loads_from_metrics(ctx.aggregated_metrics)
        return desired_replicas(loads, ctx.target_num_replicas, self.target_requests, self.target_kv_usage), {}
