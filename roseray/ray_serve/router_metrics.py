"""The Router replica's own Prometheus metrics, answered at GET /metrics on its port
(router_endpoint.py; HAProxy does not forward it from clients).

    roseray:router_kv_view_age_seconds   at each cache_aware pick, how old the cache contents
                                         are that the Router's view of the chosen replica shows
                                         (KVCacheIndex.content_age: since the replica took them,
                                         by the `ts` of the routing stats that carried them, on
                                         the replica's clock; Serve's pull and push count)
    roseray:router_kv_view_missing       picks whose chosen replica had no usable view (not
                                         heard from yet, or stale until a snapshot)

The routing simulator's view age (roseray/bench/routing_policies.py) is the same quantity,
taken over every replica at each pick. The RequestRouter (routing.py) runs in the Router
replica's process, so one RouterMetrics per process (`ROUTER_METRICS`) collects from it and is
served by the replica's HTTP app. An observation costs a bisect and two additions.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from roseray.openai_api.metrics import BisectHistogram

# a view is a stats period or two old (0.5 s by default); a stalled controller or stats pull shows past that
VIEW_AGE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)


class RouterMetrics:
    """The Router's metrics (see the module docstring); `model_name` labels them, as the engines' do."""

    def __init__(self, model_name: str = "") -> None:
        self.view_age = BisectHistogram("roseray:router_kv_view_age_seconds",
                                        "Age of the Router's view of the chosen replica's prefix cache at a "
                                        "cache_aware pick (since the replica took the contents it shows).",
                                        model_name, VIEW_AGE_BUCKETS)
        self.view_missing = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    @property
    def model_name(self) -> str:
        return self.view_age.model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        self.view_age.model_name = name

    def observe_view_age(self, age: float | None) -> None:
        """One cache_aware pick: the age of its view of the chosen replica (None: it had none)."""
        if age is None:
            self.view_missing += 1
        else:
            self.view_age.observe(age)

    def collect(self):
        yield from self.view_age.collect()
        missing = CounterMetricFamily("roseray:router_kv_view_missing",
                                      "cache_aware picks whose chosen replica had no usable cache view.",
                                      labels=["model_name"])
        missing.add_metric([self.model_name], self.view_missing)
        yield missing

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


ROUTER_METRICS = RouterMetrics()  # this process's: the Router replica's RequestRouter and HTTP app
