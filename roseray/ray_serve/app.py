"""roseray on Ray Serve: Engine replicas (the data plane) behind a Router (the control plane).

    client -> HAProxy --POST--> Router /internal/route: KVQueueRequestRouter picks a replica,
                                signs a ticket (router.policy power_of_two: Ray Serve's
                                default PowerOfTwoChoicesRequestRouter picks, for comparison;
                                cache_aware: on the replicas' exact prefix caches)
           -> HAProxy --------> that Engine replica's own FastAPI app (checks the ticket,
                                streams SSE itself: no Ray object per token)

`build_app(args)` is the import path of serve_config.yaml. HAProxy mode must be on in
the environment of Ray (see roseray.ray_serve.haproxy_env).

No `from __future__ import annotations` here: Serve ships these classes by value, and
FastAPI must see the real `Request` annotation of the route methods, not a string.
"""

import asyncio
import dataclasses
import logging
import time
from typing import Any, Literal

import ray
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from roseray import envs
from roseray.config import EngineConfig, ServerConfig
from roseray.envs import ROUTER_REPLICAS_ENV
from roseray.models.loader import load_model_config
from roseray.openai_api.api import create_app
from roseray.openai_api.api_processes import APIProcessSettings
from roseray.openai_api.metrics_share import MetricsShare
from roseray.ray_serve import router_metrics, wiring
from roseray.ray_serve.autoscaling import AutoscalingArgs, replica_count_options
from roseray.ray_serve.autoscaling_policy import engine_load_stats
from roseray.ray_serve.haproxy_env import router_replicas_in_env
from roseray.ray_serve.kv_event_feed import KVEventFeed
from roseray.ray_serve.prompt_chain import PromptChainer
from roseray.ray_serve.ready import ReadyAnnouncement
from roseray.ray_serve.replica_api_processes import ReplicaAPIProcesses, start_shared_engine
from roseray.ray_serve.router_endpoint import RouterEndpoint
from roseray.ray_serve.router_server import LeanRouterServer
from roseray.ray_serve.routing import HintConfig, KVQueueRequestRouter, hint_from_body
from roseray.ray_serve.ticket import TicketSigner, new_secret
from roseray.runtime.async_engine import AsyncLLMEngine
from roseray.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def resolve_api_key(configured: str | None) -> str | None:
    """The app's `api_key`, else ROSERAY_API_KEY from the replica's environment (runtime_env
    env_vars, or the node's environment at `ray start`), which keeps the key out of the
    Serve config that the dashboard and `serve status` show. None: no key required."""
    return configured or envs.api_key()


@serve.deployment(name="Engine")
@serve.ingress()
class EngineDeployment:
    """One engine replica: a full continuous-batching engine and its OpenAI app."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, ticket_secret: str,
                 kv_snapshot_every: int | None = None) -> None:
        """`kv_snapshot_every`: send the Router this engine's KV cache events with its routing
        stats (a snapshot every that many periods; kv_event_feed.py); None: none sent."""
        self.tickets = TicketSigner(ticket_secret)
        context = serve.get_replica_context()
        self.replica_name = f"{context.deployment}#{context.replica_id.unique_id}"
        self.server_config = dataclasses.replace(server_config, api_key=resolve_api_key(server_config.api_key))
        self.api_processes: ReplicaAPIProcesses | None = None
        self.metrics_share: MetricsShare | None = None
        if self.server_config.api_processes > 1:  # they take over the replica's port (replica_api_processes.py)
            settings = APIProcessSettings(engine_config, dataclasses.replace(self.server_config, log_level="warning"),
                                          replica_name=self.replica_name, ticket_secret=ticket_secret)
            self.engine, self.api_processes = start_shared_engine(settings, app_name=context.app_name)
            self.metrics_share = MetricsShare(self.api_processes.metrics_dir, 0)
        else:
            self.engine = AsyncLLMEngine.from_engine_config(engine_config,
                                                            stuck_after_s=self.server_config.stuck_after_s)
        self.engine.start()
        self.kv_feed = KVEventFeed(self.engine, kv_snapshot_every) if kv_snapshot_every else None
        if self.api_processes is not None:
            self.api_processes.start()  # once Serve's server listens, after this constructor

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.engine, self.server_config, replica_name=self.replica_name,
                         request_guard=self._check_ticket, metrics_share=self.metrics_share)
        if self.api_processes is not None:
            app.router.lifespan_context = self.api_processes.around_lifespan(app.router.lifespan_context)
        return app

    def _check_ticket(self, request: Request) -> str | None:
        if wiring.came_through_serve_proxy(request.scope):
            return None  # HAProxy's fallback path: Serve's proxy routed it with the deployment's RequestRouter
        return self.tickets.check_request(request)

    async def record_routing_stats(self) -> dict[str, Any]:
        s = self.engine.stats
        stats = {"queue": max(s.queue_depth, self.engine.num_active_requests), "running": s.num_running,
                 "waiting": s.num_waiting, "kv_free": s.num_free_blocks, "kv_total": s.num_total_blocks,
                 "ts": time.time()}
        if self.kv_feed is not None:
            stats["kv"] = await self.kv_feed.poll()
        return stats

    def check_health(self) -> None:
        self.engine.check_health()
        if self.api_processes is not None:
            self.api_processes.check()

    async def check_integrity(self) -> dict[str, Any]:
        """The engine's KV accounting check, run between two steps (through a DeploymentHandle:
        operators and tests; not an HTTP route). Raises if the accounting is broken."""
        return {"replica": self.replica_name, **await self.engine.check_integrity()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's load for Serve's autoscaler (autoscaling_policy.py); Serve calls it only
        when the app's `autoscaling` is set."""
        s = self.engine.stats
        return engine_load_stats(s.num_running, s.num_waiting, self.engine.num_active_requests,
                                 s.num_free_blocks, s.num_total_blocks)


@serve.deployment(name="Router")
@serve.ingress()
class RouterDeployment:
    """Answers HAProxy's /internal/route: which Engine replica, plus its ticket.

    Its HTTP app is roseray.ray_serve.router_endpoint's plain ASGI callable, not FastAPI: the
    decisions of a burst queue one after another in this replica, and FastAPI's per-request
    machinery was a large part of each. ROUTER_ACTOR_OPTIONS run the
    app and the DeploymentHandle's router on the replica's own event loop. Once Serve's server
    listens, a lean asyncio server (router_server.py) takes the replica's port over and answers
    with the same RouterEndpoint, without uvicorn and Serve's per-request wrapper; Serve's
    server stays if that fails (`lean_server=False`: keep Serve's)."""

    def __init__(self, engine: DeploymentHandle, ticket_secret: str, hint_config: dict,
                 policy: str = "kv_queue", lean_server: bool = True, served_model_name: str = "",
                 engine_config: EngineConfig | None = None) -> None:
        """`engine_config`: for policy cache_aware, whose tokenizer hashes prompts as the engine does."""
        self.engine = engine
        self.tickets = TicketSigner(ticket_secret)
        self.hint_config = HintConfig(**hint_config)
        self.policy = policy
        self.chainer = None
        if policy == "cache_aware":
            if engine_config is None:
                raise ValueError("router.policy cache_aware needs the engine config (its tokenizer)")
            model_config = load_model_config(engine_config.model, revision=engine_config.revision,
                                             load_format=engine_config.load_format)
            tokenizer = load_tokenizer(engine_config.tokenizer, model_config, engine_config.revision)
            self.chainer = PromptChainer(tokenizer, self.hint_config)
        router_metrics.ROUTER_METRICS.model_name = served_model_name
        self.endpoint = RouterEndpoint(self.pick, self.tickets, router_metrics.ROUTER_METRICS)
        if lean_server:  # takes the port over from Serve's server once it listens (router_server.py)
            try:
                server = LeanRouterServer(self.endpoint, serve.get_replica_context().app_name)
            except RuntimeError as error:  # no running event loop here (a Ray upgrade?)
                logger.warning("the lean /internal/route server cannot start; Serve's server answers: %r", error)
            else:
                self.endpoint.on_shutdown.append(server.stop)
                server.start()
        # "roseray ready at ..." once the app serves through this node's HAProxy (ready.py)
        announcement = ReadyAnnouncement(engine, serve.get_replica_context().app_name, ticket_secret,
                                         served_model_name, self.hint_config.block_size)
        try:
            self._ready_task = asyncio.get_running_loop().create_task(announcement.run())
        except RuntimeError:  # no running event loop here
            logger.warning("no event loop in the Router replica: no ready line")

    def __serve_build_asgi_app__(self) -> RouterEndpoint:
        return self.endpoint

    async def pick(self, body: bytes, session_id: str | None, truncated: str | None) -> wiring.ReplicaPick:
        """The replica for one request (RuntimeError: none can take it now)."""
        if self.policy == "power_of_two":
            return await pick_with_reservation(self.engine)
        if self.chainer is not None:  # cache_aware: the prompt's chain as the engine hashes it
            if len(body) > THREAD_TOKENIZE_BYTES:  # a long prompt: tokenized off the event loop
                hint = await asyncio.to_thread(self.chainer.hint, body, truncated)
            else:
                hint = self.chainer.hint(body, truncated)
            return await wiring.pick_replica(self.engine, hint)
        return await wiring.pick_replica(self.engine, hint_from_body(body, session_id, self.hint_config, truncated))


# cache_aware: bodies longer than this are tokenized on a worker thread (prompt_chain.py: about
# 1.5-3 ms per 1,000 tokens), so that a long prompt does not hold up the Router's other decisions.
THREAD_TOKENIZE_BYTES = 8 * 1024


# The Router replica's process runs its HTTP app and its DeploymentHandle's RequestRouter on
# the replica's own event loop (Serve's defaults: the app on a second thread and loop, the
# handle's router on a third; every decision then crosses threads four times). Read by Serve
# when the replica's process imports it, so they travel in the replica's runtime_env, not in
# the node's environment: the Engine replicas keep Serve's defaults. It saves the Router CPU
# time per decision that the thread hops cost.
ROUTER_ENV_VARS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
ROUTER_ACTOR_OPTIONS = {"num_cpus": 0, "runtime_env": {"env_vars": ROUTER_ENV_VARS}}


async def pick_with_reservation(handle: DeploymentHandle) -> wiring.ReplicaPick:
    """The replica chosen by the deployment's RequestRouter through Serve's full procedure:
    `choose_replica()` with its default slot reservation, as a DeploymentHandle call routes.

    For router.policy power_of_two (Ray's PowerOfTwoChoicesRequestRouter). The pick-only
    path (`wiring.pick_replica`, `_reserve=False`) takes the first replica the router ranks
    and never looks at queue lengths; Ray's class ranks two random replicas unsorted, so
    through that path it would route at random. Here Serve keeps the one of the two with
    the shorter queue (its cached lengths: refreshed by every reservation's and release's
    reply, probed when missing or older than 10 s), reserves a slot there and releases it
    when this returns, since HAProxy, not Serve, carries the request: two actor calls per
    request that KVQueueRequestRouter does not make. A queue length is the replica's count
    of ongoing requests, streams on its own port included; picks still on their way there
    are not in it."""
    return await wiring.pick_replica(handle, reserve=True)


class RouterArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stats_period_s: float = 0.5  # how often Serve pulls record_routing_stats from each engine replica
    affinity_max_imbalance: int = 4  # prefix affinity yields when its replica's queue is longer than this
    chars_per_token: float | None = None  # prompt-size estimate; default 1 for random:* (bytes), 4 otherwise
    # Router replicas on each proxy node. Ray 2.60 sizes the Router by RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE
    # (read at `ray start`: `python -m roseray.ray_serve.haproxy_env [--router-replicas-per-node N]`, whose auto
    # is 4 on a GPU node, 1 without), not by this. "auto": what that environment says; a number must agree
    # with it, so that the config says what runs.
    num_replicas: int | Literal["auto"] = "auto"
    # kv_queue: roseray's KVQueueRequestRouter (queue depth, free KV blocks, prefix affinity).
    # power_of_two: Ray Serve's default PowerOfTwoChoicesRequestRouter on the same data path
    # (HAProxy -> Router -> the replica streams itself), to compare routers; ignores the KV
    # stats and affinity_max_imbalance.
    # cache_aware: KVQueueRequestRouter on the replicas' exact prefix cache contents (their KV cache
    # events ride on the routing stats) and their load (roseray/ray_serve/cache_aware.py); the Router
    # tokenizes prompts with the engine's tokenizer, which must be on the Router's node.
    policy: Literal["kv_queue", "power_of_two", "cache_aware"] = "kv_queue"
    kv_snapshot_every: int = Field(20, ge=1)  # cache_aware: a full cache snapshot every N stats periods
    prefill_weight: float = Field(1.0, gt=0)  # cache_aware: cost per prompt block still to prefill
    load_weight: float | None = Field(None, ge=0)  # cache_aware: cost per request there; None: adaptive

    @field_validator("num_replicas")
    @classmethod
    def _ray_runs_that_many(cls, value: int | str) -> int | str:
        per_node = router_replicas_in_env()
        if value != "auto" and value != per_node:
            raise ValueError(f"router.num_replicas={value}, but Ray runs {ROUTER_REPLICAS_ENV}={per_node} Router "
                             f"replica(s) per proxy node and ignores the deployment's count: start Ray after "
                             "`eval \"$(python -m roseray.ray_serve.haproxy_env --router-replicas-per-node "
                             f"{value})\"`")
        return value

    def replicas(self) -> int:
        """The Router replicas Ray runs on each proxy node."""
        return router_replicas_in_env() if self.num_replicas == "auto" else self.num_replicas


# API processes per GPU engine replica under "auto". Four write every stream every step at 128
# streams of GPT-2. Two let the engine step a little faster (one client fewer to send each step
# to) but each admits twice a burst and writes two steps at once now and then: a burst's TTFT
# grew by half (the H100 runs are in the git history of BENCHMARKS.md).
GPU_REPLICA_API_PROCESSES = 4

# How often a stopping replica counts its requests in flight (Serve's graceful_shutdown_wait_loop_s).
# Serve's 2 s is a wait before the first count: an idle Router then held every stop that long
# (Serve stops the Router before the Engine replicas). Polling costs nothing here.
SHUTDOWN_POLL_S = 0.2


_SERVER = ServerConfig()  # the defaults of AppArgs' server settings


class AppArgs(BaseModel):
    """The `args:` of serve_config.yaml."""

    model_config = ConfigDict(extra="forbid")
    engine: dict[str, Any] = Field(default_factory=dict)  # roseray.config.EngineConfig fields
    num_replicas: int | Literal["auto"] = "auto"  # "auto": one per GPU in the cluster, or 1 without GPUs
    # Engine replicas that follow the engines' load (ray_serve/autoscaling.py); None: a fixed num_replicas.
    # When set, num_replicas is the count Serve starts with ("auto": min_replicas).
    autoscaling: AutoscalingArgs | None = None
    num_gpus_per_replica: float | Literal["auto"] = "auto"  # "auto": tensor_parallel_size with GPUs, else 0
    num_cpus_per_replica: float = 1.0
    # Placement on a multi-node cluster (deploy/README.md, "Replica placement"): custom resources each
    # engine replica reserves (a node offers them at `ray start --resources`), pinning replicas to the nodes
    # that offer them; and Serve's cap on this deployment's replicas per node (None: no cap).
    resources_per_replica: dict[str, float] = Field(default_factory=dict)
    max_replicas_per_node: int | None = None
    # processes that write each engine replica's HTTP streams, on the replica's port: 1 is the replica's
    # own server; N > 1 starts N API processes that take the port over (ray_serve/replica_api_processes.py).
    # "auto": GPU_REPLICA_API_PROCESSES on GPU replicas (one process cannot write 128 streams every
    # sub-millisecond step), 1 on CPU.
    # More than 1 needs the engine in its own process (engine.engine_process; the default on CUDA).
    api_processes_per_replica: int | Literal["auto"] = "auto"
    # The engine replicas' ServerConfig fields, with its defaults and its checks (when these args are
    # read); roseray.config.ServerConfig says what each does. Host and port are Serve's http_options.
    # api_key: better ROSERAY_API_KEY in the engine replicas' environment (kept out of this config).
    served_model_name: str | None = _SERVER.served_model_name
    api_key: str | None = _SERVER.api_key
    cors_origins: list[str] = Field(default_factory=list)
    max_body_bytes: int = _SERVER.max_body_bytes
    drain_timeout_s: float = _SERVER.drain_timeout_s
    stuck_after_s: float = _SERVER.stuck_after_s
    log_requests: bool = _SERVER.log_requests
    log_prompts: bool = _SERVER.log_prompts
    enable_docs: bool = _SERVER.enable_docs
    tool_call_parser: str | None = _SERVER.tool_call_parser  # what tool_choice "auto" parses with (--tool-call-parser)
    ticket_secret: str | None = None  # shared by Router and Engine; random per build when unset
    router: RouterArgs = Field(default_factory=RouterArgs)

    @model_validator(mode="after")
    def _valid_server_config(self) -> "AppArgs":
        self.server_config(api_processes=1)  # ServerConfig's checks, when the config is read
        return self

    def server_config(self, api_processes: int) -> ServerConfig:
        """The engine replicas' ServerConfig (ValueError: a setting out of range)."""
        return ServerConfig(served_model_name=self.served_model_name, api_key=self.api_key,
                            cors_origins=tuple(self.cors_origins), max_body_bytes=self.max_body_bytes,
                            drain_timeout_s=self.drain_timeout_s, stuck_after_s=self.stuck_after_s,
                            log_requests=self.log_requests, log_prompts=self.log_prompts,
                            enable_docs=self.enable_docs, api_processes=api_processes,
                            tool_call_parser=self.tool_call_parser)


def _placement(args: AppArgs, tensor_parallel_size: int) -> tuple[int, float]:
    """(replicas, GPUs per replica). A tensor-parallel replica reserves all its GPUs in its own
    actor's resources (one node, the GPUs Ray gives the actor: rank r of the engine uses the r-th),
    so Serve places and replaces it as one unit; "auto" is tensor_parallel_size GPUs."""
    gpus = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0
    if args.num_gpus_per_replica == "auto":
        num_gpus = float(tensor_parallel_size) if gpus else 0.0
    else:
        num_gpus = float(args.num_gpus_per_replica)
        if gpus and num_gpus < tensor_parallel_size:
            raise ValueError(f"num_gpus_per_replica={args.num_gpus_per_replica} is fewer than the engine's "
                             f"tensor_parallel_size={tensor_parallel_size} (one GPU per rank)")
    if args.num_replicas == "auto":
        num_replicas = max(1, int(gpus // num_gpus)) if num_gpus else 1
    else:
        num_replicas = int(args.num_replicas)
    return num_replicas, num_gpus


def _api_processes(args: AppArgs, num_gpus: float, engine_config: EngineConfig) -> int:
    if args.api_processes_per_replica == "auto":
        return GPU_REPLICA_API_PROCESSES if num_gpus and engine_config.engine_process is not False else 1
    if args.api_processes_per_replica < 1:
        raise ValueError("api_processes_per_replica must be >= 1")
    return args.api_processes_per_replica


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The roseray application: Engine replicas with the Router as their ingress request router."""
    wiring.check_ray_version()
    if not wiring.haproxy_enabled():
        raise RuntimeError(wiring.HAPROXY_REQUIRED)
    app_args = AppArgs(**(args or {}))
    engine_config = EngineConfig.from_kwargs(**app_args.engine)  # a clear error here, before any replica starts
    num_replicas, num_gpus = _placement(app_args, engine_config.tensor_parallel_size)
    api_processes = _api_processes(app_args, num_gpus, engine_config)
    if api_processes > 1:
        if engine_config.engine_process is False:
            raise ValueError(f"api_processes_per_replica={api_processes} needs the engine in its own process: "
                             "drop engine.engine_process: false, or set api_processes_per_replica: 1")
        engine_config = dataclasses.replace(engine_config, engine_process=True)
    secret = app_args.ticket_secret or new_secret()
    chars_per_token = app_args.router.chars_per_token or (1.0 if engine_config.model.startswith("random:") else 4.0)
    hint_config = dataclasses.asdict(HintConfig(block_size=engine_config.block_size, chars_per_token=chars_per_token))

    router_args = app_args.router
    if router_args.policy == "power_of_two":
        router_class: dict[str, Any] = {}  # RequestRouterConfig's default: Ray's PowerOfTwoChoicesRequestRouter
    else:
        router_kwargs: dict[str, Any] = {"affinity_max_imbalance": router_args.affinity_max_imbalance,
                                         "stats_period_s": router_args.stats_period_s}
        if router_args.policy == "cache_aware":
            router_kwargs.update(policy="cache_aware", prefill_weight=router_args.prefill_weight,
                                 load_weight=router_args.load_weight)
        router_class = {"request_router_class": KVQueueRequestRouter, "request_router_kwargs": router_kwargs}
    cache_aware = router_args.policy == "cache_aware"

    engine = EngineDeployment.options(
        **replica_count_options(app_args.autoscaling, num_replicas, app_args.num_replicas, engine_config.max_num_seqs),
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": app_args.num_cpus_per_replica,
                           **({"resources": app_args.resources_per_replica} if app_args.resources_per_replica else {})},
        max_replicas_per_node=app_args.max_replicas_per_node,
        max_ongoing_requests=engine_config.max_num_seqs + engine_config.max_waiting_requests + 64,
        # the drain, then (API processes) their own uvicorn shutdown and the engine child's exit
        graceful_shutdown_timeout_s=app_args.drain_timeout_s + (5 if api_processes == 1 else 20),
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        health_check_period_s=5.0,
        health_check_timeout_s=30.0,
        request_router_config=RequestRouterConfig(
            **router_class,
            request_routing_stats_period_s=app_args.router.stats_period_s,
            request_routing_stats_timeout_s=max(1.0, 2 * app_args.router.stats_period_s),
        ),
    ).bind(engine_config, app_args.server_config(api_processes), secret,
           kv_snapshot_every=router_args.kv_snapshot_every if cache_aware else None)
    router = RouterDeployment.options(
        num_replicas=app_args.router.replicas(), ray_actor_options=ROUTER_ACTOR_OPTIONS,
        max_ongoing_requests=10_000, graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
    ).bind(engine, secret, hint_config, app_args.router.policy,
           served_model_name=app_args.served_model_name or engine_config.model,
           engine_config=engine_config if cache_aware else None)
    if app_args.autoscaling is not None:
        logger.info("roseray app: autoscaling the engine replicas on engine load: %s", app_args.autoscaling)
    logger.info("roseray app: %d engine replica(s) of %s, %s GPU and %d API process(es) each; %d Router(s) per "
                "proxy node, policy %s", num_replicas, engine_config.model, num_gpus, api_processes,
                app_args.router.replicas(), app_args.router.policy)
    return wiring.attach_ingress_router(engine, router)
