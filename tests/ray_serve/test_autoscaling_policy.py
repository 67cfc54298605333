"""The autoscaling policy (Ray-free: replicas' load -> replicas) and the `autoscaling:` args."""

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from roseray.ray_serve.autoscaling import AutoscalingArgs, replica_count_options
from roseray.ray_serve.autoscaling_policy import (
    KV_USAGE_METRIC,
    REQUESTS_METRIC,
    EngineLoadPolicy,
    ReplicaLoad,
    desired_replicas,
    engine_load_stats,
)


@pytest.mark.parametrize("requests, kv, expected", [
    ([0.0], [0.0], 1),  # idle: one replica, never zero
    ([4.0], [0.1], 1),  # exactly the target
    ([4.5], [0.1], 2),  # past it
    ([8.0, 8.0], [0.2, 0.2], 4),  # 16 requests at 4 each
    ([1.0, 0.0], [0.05, 0.0], 1),  # two replicas nearly idle: one is enough
    ([1.0, 1.0], [0.85, 0.85], 2),  # few requests but full KV caches: KV decides
    ([1.0, 1.0], [0.95, 0.95], 3),
])
def test_desired_replicas_is_the_larger_of_the_request_and_kv_counts(requests, kv, expected):
    loads = [ReplicaLoad(r, k) for r, k in zip(requests, kv)]
    assert desired_replicas(loads, current=2, target_requests=4, target_kv_usage=0.9) == expected


def test_no_report_keeps_the_current_count():
    assert desired_replicas([], current=3, target_requests=4, target_kv_usage=0.9) == 3


def test_engine_load_stats_counts_accepted_requests_and_used_blocks():
    stats = engine_load_stats(num_running=3, num_waiting=2, num_active=7, num_free_blocks=30, num_total_blocks=40)
    assert stats == {REQUESTS_METRIC: 7.0, KV_USAGE_METRIC: 0.25}
    assert engine_load_stats(3, 2, 0, 40, 40)[REQUESTS_METRIC] == 5.0
    assert all(isinstance(v, float) for v in stats.values())  # Serve refuses other types


def test_the_policy_reads_serves_aggregated_metrics():
    policy = EngineLoadPolicy(target_requests_per_replica=4, target_kv_usage=0.9)
    busy = SimpleNamespace(target_num_replicas=1, aggregated_metrics={
        REQUESTS_METRIC: {"r1": 9.0}, KV_USAGE_METRIC: {"r1": 0.3}})
    assert policy(busy) == (3, {})
    starting = SimpleNamespace(target_num_replicas=2, aggregated_metrics={})  # no replica reported yet
    assert policy(starting) == (2, {})
    with pytest.raises(ValueError):
        EngineLoadPolicy(target_requests_per_replica=0, target_kv_usage=0.9)


def test_autoscaling_args_become_serves_config_with_roseray_policy():
    args = AutoscalingArgs(min_replicas=1, max_replicas=3, upscale_delay_s=2, downscale_delay_s=5)
    assert replica_count_options(None, 2, 2, 8) == {"num_replicas": 2}
    (config,) = replica_count_options(args, 1, "auto", 8).values()
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (1, 3, 1)
    assert (config.upscale_delay_s, config.downscale_delay_s) == (2, 5)
    assert config.policy.policy_function.endswith("autoscaling_policy.EngineLoadPolicy")
    assert config.policy.policy_kwargs == {"target_requests_per_replica": 8.0, "target_kv_usage": 0.9}
    assert replica_count_options(args, 2, 2, 8)["autoscaling_config"].initial_replicas == 2
    with pytest.raises(ValueError, match="initial count"):
        args.config(4, 8)
    with pytest.raises(ValidationError):
        AutoscalingArgs(min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError):
        AutoscalingArgs(min_replicas=0, max_replicas=2)
