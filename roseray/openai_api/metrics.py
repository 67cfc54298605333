"""Prometheus metrics of one engine replica, vLLM's names under `roseray:`.

Latency histograms and finish counters are observed per request by the API; engine
gauges and counters (running, waiting, KV usage, prefix cache, tokens, preemptions) are
read from the engine loop's latest stats snapshot at scrape time, so the hot path pays
nothing for them. Each app has its own registries (several apps may live in one process).
With several API processes in front of one engine, `share` adds the other processes'
request metrics to a scrape (metrics_share.py); the engine's are the same in all.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from roseray.openai_api.metrics_share import MetricsShare
from roseray.runtime.async_engine import AsyncEngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
_MESSAGE_DELAY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class BisectHistogram:
    """A histogram observed on a hot path (inter_token_latency_seconds, once per streamed
    token; engine_message_delay_seconds, once per engine step): a bisect into plain counters
    instead of prometheus_client's loop over locked buckets, exported as an ordinary
    Prometheus histogram at scrape time. An observation from another thread (the engine
    client's) may be half seen by a scrape that runs meanwhile, never lost."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric([self.model_name], buckets, self.sum)
        yield family


class _EngineStatsCollector:
    def __init__(self, model_name: str, read_stats: Callable[[], AsyncEngineStats]) -> None:
        self.model_name = model_name
        self.read_stats = read_stats

    def collect(self):
        s = self.read_stats()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"roseray:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"roseray:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", s.kv_cache_usage)
        yield gauge("num_kv_blocks_free", "Free KV cache blocks.", s.num_free_blocks)
        yield gauge("num_kv_blocks_total", "KV cache blocks.", s.num_total_blocks)
        yield gauge("engine_heartbeat_age_seconds", "Seconds since the engine loop last stepped or woke.",
                    max(0.0, time.monotonic() - s.last_heartbeat))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("num_preemptions", "Requests preempted (recomputed later).", s.num_preemptions_total)
        yield counter("engine_steps", "Engine steps run.", s.engine_steps_total)
        yield counter("engine_step_seconds", "Seconds the engine spent in its steps (schedule, launch, results).",
                      s.engine_step_seconds_total)
        yield counter("engine_output_seconds", "Seconds the engine process spent sending its steps' outputs to "
                      "the API processes (encoding and pipe writes).", s.engine_output_seconds_total)


class ServerMetrics:
    """`registry`: what this process observes per request; `engine_registry`: the engine's
    stats, read at scrape time."""

    def __init__(self, model_name: str, read_stats: Callable[[], AsyncEngineStats],
                 share: MetricsShare | None = None) -> None:
        self.share = share
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"roseray:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = BisectHistogram("roseray:inter_token_latency_seconds", "Time between output tokens.", model_name,
                                   _ITL_BUCKETS)
        self.registry.register(self.itl)
        self.message_delay = BisectHistogram(
            "roseray:engine_message_delay_seconds", "Time from the engine process sending a step's outputs to the "
            "API process reading them (engine process only).", model_name, _MESSAGE_DELAY_BUCKETS)
        self.registry.register(self.message_delay)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled.",
                                    _LATENCY_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                       _TOKEN_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens", "Output length of finished requests.",
                                           _TOKEN_BUCKETS)
        success = Counter("roseray:request_success", "Finished requests by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self._success = {reason: success.labels(model_name, reason) for reason in ("stop", "length", "abort", "error")}
        self.engine_registry = CollectorRegistry(auto_describe=True)
        self.engine_registry.register(_EngineStatsCollector(model_name, read_stats))

    def render(self) -> bytes:
        requests = self.registry if self.share is None else self.share.summed(self.registry)
        return generate_latest(requests) + generate_latest(self.engine_registry)

    def request_timer(self, arrival_time: float) -> RequestTimer:
        return RequestTimer(self, arrival_time)


class RequestTimer:
    """Latency bookkeeping of one request (times from time.monotonic()). Each request is
    counted once in request_success by how it ended: its finish reason, "error" when its
    stream failed, or "abort" when the client went away first."""

    __slots__ = ("metrics", "arrival_time", "last_token_time", "counted")

    def __init__(self, metrics: ServerMetrics, arrival_time: float) -> None:
        self.metrics = metrics
        self.arrival_time = arrival_time
        self.last_token_time: float | None = None
        self.counted = False

    def on_tokens(self, num_tokens: int, now: float) -> None:
        if num_tokens <= 0:
            return
        if self.last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival_time)
            num_tokens -= 1
        if num_tokens > 0:
            gap = (now - self.last_token_time) / num_tokens if self.last_token_time is not None else 0.0
            self.metrics.itl.observe(gap, num_tokens)
        self.last_token_time = now

    def on_finish(self, finish_reason: str | None, now: float, *, num_prompt_tokens: int, num_output_tokens: int,
                  arrival_time: float | None, first_scheduled_time: float | None) -> None:
        m = self.metrics
        m.e2e.observe(now - self.arrival_time)
        if first_scheduled_time is not None and arrival_time is not None:
            m.queue_time.observe(max(0.0, first_scheduled_time - arrival_time))
        m.prompt_tokens.observe(num_prompt_tokens)
        m.generation_tokens.observe(num_output_tokens)
        self.count(finish_reason or "error")

    def count(self, finished_reason: str) -> None:
        """Count the request in request_success under `finished_reason`, unless it was counted."""
        if self.counted:
            return
        self.counted = True
        counter = self.metrics._success.get(finished_reason)
        if counter is not None:
            counter.inc()

    def on_response_end(self) -> None:
        """The response ended: a request not counted by then was left by its client (abort)."""
        self.count("abort")
