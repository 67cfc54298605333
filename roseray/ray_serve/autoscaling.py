"""`autoscaling:` of serve_config.yaml's args: how the Engine deployment's replica count follows the
engines' own load, through Ray Serve's autoscaler with roseray's policy (autoscaling_policy.py).

Off unless set. When set, the app's `num_replicas` is the count Serve starts with (`initial_replicas`;
it must lie in [min_replicas, max_replicas]); "auto" starts at min_replicas.

What Serve guarantees around a change (and roseray's paths keep): a new replica gets traffic only
once it is RUNNING (its constructor, and with it the engine's start, has returned; Serve then adds it
to the Router's replica set and HAProxy's backends). A replica Serve stops by scaling down leaves the
Router's set and HAProxy's backends first (Serve's direct-ingress draining period), then Serve waits
for its ongoing requests (streams on its port included) up to graceful_shutdown_timeout_s, and the
replica's app shutdown drains the engine for drain_timeout_s: in-flight streams finish.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from roseray.ray_serve.autoscaling_policy import EngineLoadPolicy


class AutoscalingArgs(BaseModel):
    """Replica-count bounds, the load one replica should carry, and how long a change must hold."""

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=1)  # no scale to zero: HAProxy and the Router need a replica to send to
    max_replicas: int = Field(..., ge=1)
    # the load one replica should carry: running + waiting requests (None: the engine's max_num_seqs,
    # a full batch), and the fraction of its KV cache in use; more on average asks for more replicas
    target_requests_per_replica: float | None = Field(None, gt=0)
    target_kv_usage: float = Field(0.9, gt=0, le=1)
    upscale_delay_s: float = Field(30.0, ge=0)  # the load must ask for more replicas this long
    downscale_delay_s: float = Field(300.0, ge=0)  # ... or for fewer this long
    look_back_period_s: float = Field(10.0, gt=0)  # each replica's load is averaged over this window
    metrics_interval_s: float = Field(1.0, gt=0)  # how often replicas report their load to Serve

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingArgs:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling.max_replicas={self.max_replicas} < min_replicas={self.min_replicas}")
        return self

    def config(self, num_replicas: int | Literal["auto"], max_num_seqs: int) -> AutoscalingConfig:
        """Serve's AutoscalingConfig for the Engine deployment (ValueError: num_replicas out of bounds)."""
        initial = self.min_replicas if num_replicas == "auto" else int(num_replicas)
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"num_replicas={num_replicas} (the initial count under autoscaling) must lie in "
                             f"[{self.min_replicas}, {self.max_replicas}]")
        policy_kwargs = {"target_requests_per_replica": self.target_requests_per_replica or float(max_num_seqs),
                         "target_kv_usage": self.target_kv_usage}
        return AutoscalingConfig(
            min_replicas=self.min_replicas, max_replicas=self.max_replicas, initial_replicas=initial,
            upscale_delay_s=self.upscale_delay_s, downscale_delay_s=self.downscale_delay_s,
            look_back_period_s=self.look_back_period_s, metrics_interval_s=self.metrics_interval_s,
            policy=AutoscalingPolicy(policy_function=EngineLoadPolicy, policy_kwargs=policy_kwargs))


def replica_count_options(autoscaling: AutoscalingArgs | None, num_replicas: int, requested: int | str,
                          max_num_seqs: int) -> dict[str, Any]:
    """The Engine deployment's replica-count options: a fixed `num_replicas`, or (autoscaling set)
    Serve's autoscaling_config, starting at `requested` ("auto": min_replicas)."""
    if autoscaling is None:
        return {"num_replicas": num_replicas}
    return {"autoscaling_config": autoscaling.config(requested, max_num_seqs)}
