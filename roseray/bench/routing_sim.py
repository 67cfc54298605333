"""Discrete-event simulation of N engine replicas behind a router, with the model's time
replaced by a step-time model (routing_step_time.py).

Each replica is roseray's real Scheduler and BlockManager (continuous batching, chunked
prefill, prefix caching, LRU eviction, preemption by recompute), driven as Engine drives
them with overlap off: `schedule()`, the step's tokens computed (`num_computed_tokens`), one
token appended to each request whose prompt is done (the ids the workload scripts, or 0),
full blocks committed to the prefix cache, requests at their max_tokens finished
(`finish_many`). The step lasts what the step-time model says; the next one starts when it
ends. With `ReplicaConfig.async_scheduling` (the engine's default on a GPU) the next step was
scheduled when the current one started, so a request that reaches a busy replica joins the
step after the next: it waits until the start of the step in flight has passed its arrival.
The router sees each replica's routing stats (queue, kv_free, ts) as Serve pulls them every
`stats_period_s` (app.py's RouterArgs default: 0.5 s), each replica at its own phase;
for a policy that `wants_kv_events` (cache_aware), the stats also carry the replica's KV cache
events as the app's replica sends them: the real KVEventFeed over the BlockManager's real
event log (a batch per period, a snapshot every `kv_snapshot_every` periods or on resync).
A request reaches its replica the moment it is routed. By default the stats reach the router
the moment they are taken, every period exactly; `serve_stats_timing` gives Ray Serve's
controller's timing instead (SERVE_STATS_TIMING: each pull after period x U(0.9, 1.1), at the
controller's next visit of the replica (its round-robin sweep: every half period), the
result picked up at a control tick (every 0.1 s) and broadcast), which is what dates the
Router's view in a real deployment.
"""

from __future__ import annotations

import heapq
import random
import time
from array import array
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from roseray.bench.routing_policies import RouteRequest
from roseray.bench.routing_step_time import StepTimeModel, step_shape
from roseray.engine.block_manager import BlockManager
from roseray.engine.request import Request, RequestStatus
from roseray.engine.scheduler import Scheduler, SchedulerOutput
from roseray.ray_serve.kv_event_feed import KVEventFeed
from roseray.sampling_params import SamplingParams

_PARAMS = SamplingParams(temperature=0.0, ignore_eos=True)

# Ray Serve 2.x's controller (ray/serve/_private: deployment_state.py's _should_record_routing_stats
# and _process_healthy_replica, constants.py's CONTROL_LOOP_INTERVAL_S and
# CONTROLLER_HEALTH_CHECK_RECONCILIATION_FRACTION), as fractions of the stats period or seconds
SERVE_STATS_JITTER = 0.1  # a pull starts period x U(1 - j, 1 + j) after the previous one ...
SERVE_STATS_VISIT = 0.5  # ... at the controller's next visit: its sweep takes this x the period
SERVE_STATS_DELIVERY_S = 0.1  # the result is picked up at the next control tick


def serve_stats_timing(period_s: float) -> dict:
    """simulate()'s stats timing keywords for Ray Serve's controller at this stats period."""
    return {"stats_jitter": SERVE_STATS_JITTER, "stats_visit_s": SERVE_STATS_VISIT * period_s,
            "stats_delivery_s": SERVE_STATS_DELIVERY_S}


@dataclass(frozen=True)
class ReplicaConfig:
    """One simulated engine. The KV capacity is an assumption (a Qwen3-0.6B replica on an H100
    holds ~500k tokens; 131k stands for a larger model's tighter cache, as llm-d's 32B had)."""

    num_blocks: int = 8192
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 16384
    async_scheduling: bool = False  # the next step scheduled while the current one runs (module docstring)


@dataclass
class _Record:
    """Per request: what the metrics need."""

    arrival_s: float
    replica: int
    output_ids: list[int] | None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_s: float | None = None


class _BlockManagerEvents:
    """What KVEventFeed asks of an engine, answered from a simulated replica's BlockManager."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager

    async def kv_events(self, snapshot: bool = False):
        return self.block_manager.kv_cache_snapshot() if snapshot else self.block_manager.drain_kv_events()


def _run_now(coroutine):
    """The result of a coroutine that never suspends (KVEventFeed.poll over _BlockManagerEvents),
    without an event loop: the simulation's clock is its own."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the KV event feed suspended; the simulator cannot wait on it")


class SimReplica:
    def __init__(self, replica_id: int, config: ReplicaConfig, model: StepTimeModel,
                 kv_snapshot_every: int | None = None) -> None:
        self.replica_id = replica_id
        self.config, self.model = config, model
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.max_num_seqs,
                                          config.max_model_len // config.block_size + 1)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len)
        self.routing_stats: dict = {}
        self.stats_in_flight: deque[dict] = deque()  # taken, not yet delivered to the router
        self.stats_delivered_at = 0.0  # the last delivery's time (deliveries keep their order)
        self.kv_feed = (KVEventFeed(_BlockManagerEvents(self.block_manager), kv_snapshot_every)
                        if kv_snapshot_every else None)
        self.batch: SchedulerOutput | None = None  # the step in flight
        self.step_started_s = 0.0  # when the step in flight started
        self.pending: deque[Request] = deque()  # async scheduling: arrived after the next step was scheduled
        self.num_requests = 0
        self.busy_s = 0.0

    def add(self, request: Request) -> None:
        if self.config.async_scheduling and self.batch is not None:
            self.pending.append(request)
        else:
            self.scheduler.add(request)

    @property
    def num_active(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting) + len(self.pending)

    def take_stats(self, now: float) -> dict:
        """What the app's record_routing_stats answers now (with its KV events, if fed)."""
        stats = {"queue": self.num_active, "running": len(self.scheduler.running),
                 "waiting": len(self.scheduler.waiting) + len(self.pending),
                 "kv_free": self.block_manager.num_free_blocks, "kv_total": self.block_manager.num_blocks, "ts": now}
        if self.kv_feed is not None:
            stats["kv"] = _run_now(self.kv_feed.poll())
        return stats

    def snapshot(self, now: float) -> None:
        """Stats taken now and delivered at once."""
        self.routing_stats = self.take_stats(now)

    def start_step(self, now: float) -> float | None:
        """Schedule the next step; its duration, or None when there is nothing to run."""
        # async scheduling: this step was scheduled when the previous one started (nothing to run
        # then: now, with everything that arrived since)
        while self.pending and self.pending[0].arrival_time <= self.step_started_s:
            self.scheduler.add(self.pending.popleft())
        batch = self.scheduler.schedule()
        if not batch and self.pending:
            while self.pending:
                self.scheduler.add(self.pending.popleft())
            batch = self.scheduler.schedule()
        if not batch:
            return None
        self.batch, self.step_started_s = batch, now
        seconds = self.model.shape_seconds(step_shape(batch))
        self.busy_s += seconds
        return seconds

    def finish_step(self, now: float, records: dict[str, _Record], itl: array) -> None:
        """The step in flight is done at `now`: its tokens, their commits, the requests it finished."""
        batch, self.batch = self.batch, None
        block_size, commit = self.block_manager.block_size, self.block_manager.commit_full_blocks
        finished = []
        for req, num_new in zip(batch.requests, batch.num_new_tokens):
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_tokens:
                record = records[req.request_id]
                index = len(req.output_token_ids)
                token = record.output_ids[index] if record.output_ids is not None else 0
                req.output_token_ids.append(token)
                req.token_ids.append(token)
                if record.first_token_s is None:
                    record.first_token_s = now
                else:
                    itl.append(now - record.last_token_s)
                record.last_token_s = now
                if index + 1 >= req.max_tokens:
                    record.finish_s = now
                    finished.append(req)
                    continue
            if req.num_computed_tokens // block_size > req.num_committed_blocks:
                commit(req, req.num_tokens)
        if finished:
            self.scheduler.finish_many(finished, [RequestStatus.FINISHED_LENGTH] * len(finished))

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(list(self.scheduler.running) + list(self.scheduler.waiting)
                                           + list(self.pending))


@dataclass
class SimResult:
    workload: str
    policy: str
    replicas: int
    qps: float
    num_requests: int
    num_finished: int
    sim_seconds: float
    wall_seconds: float
    ttft_s: np.ndarray
    itl_s: np.ndarray
    output_tokens: int
    hit_rate: float
    requests_per_replica: list[int]
    preemptions: int
    extra: dict = field(default_factory=dict)
    policy_stats: dict = field(default_factory=dict)  # what the policy measured (cache_aware: its view's age)

    def summary(self) -> dict:
        def pct(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q)) if values.size else float("nan")

        per_replica = np.asarray(self.requests_per_replica, dtype=float)
        return {
            "workload": self.workload, "policy": self.policy, "replicas": self.replicas, "qps": self.qps,
            "requests": self.num_requests, "finished": self.num_finished,
            "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p90_s": pct(self.ttft_s, 90), "ttft_p99_s": pct(self.ttft_s, 99),
            "itl_p99_ms": pct(self.itl_s, 99) * 1e3,
            "output_tok_s": self.output_tokens / self.sim_seconds if self.sim_seconds else 0.0,
            "prefix_hit_rate": self.hit_rate,
            "load_spread": float(per_replica.max() / per_replica.mean()) if per_replica.sum() else float("nan"),
            "preemptions": self.preemptions, "sim_s": self.sim_seconds, "wall_s": self.wall_seconds,
            **self.policy_stats,
        }


def simulate(workload, policy, num_replicas: int, *, qps: float = 0.0, config: ReplicaConfig = ReplicaConfig(),
             model: StepTimeModel | None = None, stats_period_s: float = 0.5, max_sim_s: float | None = None,
             seed: int = 0, check_every: int = 0, kv_snapshot_every: int = 20, stats_jitter: float = 0.0,
             stats_visit_s: float = 0.0, stats_delivery_s: float = 0.0) -> SimResult:
    """Run `workload` (its specs and prompts) through `policy` over `num_replicas` replicas until
    every request finishes or `max_sim_s`. TTFT of a request without a first token by then is
    counted as the time it waited (a lower bound), so an overloaded policy still shows.
    `check_every` > 0: check each replica's BlockManager integrity every that many steps.
    `kv_snapshot_every`: the KV event feed's snapshot period (RouterArgs' default), for a
    policy that `wants_kv_events`. `stats_jitter`, `stats_visit_s`, `stats_delivery_s`: the
    stats' timing (module docstring; serve_stats_timing); 0, 0, 0: every period, delivered at once."""
    started = time.perf_counter()
    model = model or StepTimeModel()
    feed = kv_snapshot_every if getattr(policy, "wants_kv_events", False) else None
    replicas = [SimReplica(i, config, model, feed) for i in range(num_replicas)]
    rng = random.Random(seed)
    events: list[tuple[float, int, int, int]] = []  # (time, tiebreak, kind, replica)
    step_done, stats, deliver = 0, 1, 2
    stats_rng = random.Random(seed * 7919 + 1)  # its own: the default timing draws nothing
    counter = 0
    for r in replicas:
        r.snapshot(0.0)
        counter += 1
        heapq.heappush(events, (rng.uniform(0, stats_period_s), counter, stats, r.replica_id))
    specs = workload.specs
    records: dict[str, _Record] = {}
    itl = array("d")
    next_arrival, busy, steps, now = 0, 0, 0, 0.0
    while next_arrival < len(specs) or busy:
        arrival_s = specs[next_arrival].arrival_s if next_arrival < len(specs) else float("inf")
        if events[0][0] <= arrival_s:
            now, _, kind, index = heapq.heappop(events)
        else:
            now, kind, index = arrival_s, -1, -1
        if max_sim_s is not None and now > max_sim_s:
            now = max_sim_s
            break
        if kind == stats:
            replica = replicas[index]
            if stats_delivery_s > 0:
                replica.stats_in_flight.append(replica.take_stats(now))
                replica.stats_delivered_at = max(replica.stats_delivered_at,
                                                 now + stats_rng.uniform(0, stats_delivery_s))
                counter += 1
                heapq.heappush(events, (replica.stats_delivered_at, counter, deliver, index))
            else:
                replica.snapshot(now)
            period = stats_period_s * (stats_rng.uniform(1 - stats_jitter, 1 + stats_jitter) if stats_jitter else 1)
            period += stats_rng.uniform(0, stats_visit_s) if stats_visit_s else 0.0
            counter += 1
            heapq.heappush(events, (now + period, counter, stats, index))
            continue
        if kind == deliver:
            replica = replicas[index]
            replica.routing_stats = replica.stats_in_flight.popleft()
            continue
        if kind == -1:
            spec = specs[next_arrival]
            next_arrival += 1
            prompt = workload.prompt_ids(spec)
            replica = policy.choose(replicas, RouteRequest(prompt, spec.max_tokens, config.block_size), now)
            records[spec.request_id] = _Record(now, replica.replica_id, workload.output_ids(spec))
            replica.add(Request(spec.request_id, prompt, _PARAMS, max_tokens=spec.max_tokens, arrival_time=now))
            replica.num_requests += 1
            if replica.batch is not None:
                continue
            busy += 1
        else:
            replica = replicas[index]
            replica.finish_step(now, records, itl)
            steps += 1
            if check_every and steps % check_every == 0:
                replica.check_integrity()
        seconds = replica.start_step(now)
        if seconds is None:
            busy -= 1
            continue
        counter += 1
        heapq.heappush(events, (now + seconds, counter, step_done, replica.replica_id))
    ttft, num_finished = [], 0
    for record in records.values():
        ttft.append((record.first_token_s if record.first_token_s is not None else now) - record.arrival_s)
        num_finished += record.finish_s is not None
    output_tokens = len(itl) + sum(1 for r in records.values() if r.first_token_s is not None)
    queries = sum(r.block_manager.prefix_cache_queries for r in replicas)
    hits = sum(r.block_manager.prefix_cache_hits for r in replicas)
    if check_every:
        for r in replicas:
            r.check_integrity()
    return SimResult(
        workload=workload.name, policy=policy.name, replicas=num_replicas, qps=qps, num_requests=len(specs),
        num_finished=num_finished, sim_seconds=now, wall_seconds=time.perf_counter() - started,
        ttft_s=np.asarray(ttft), itl_s=np.frombuffer(itl, dtype=np.float64) if len(itl) else np.zeros(0),
        output_tokens=output_tokens, hit_rate=hits / queries if queries else 0.0,
        requests_per_replica=[r.num_requests for r in replicas],
        preemptions=sum(r.scheduler.num_preemptions_total for r in replicas),
        extra={"steps": steps, "gpu_busy": [r.busy_s / now if now else 0.0 for r in replicas]},
        policy_stats=policy.measurements() if hasattr(policy, "measurements") else {})
