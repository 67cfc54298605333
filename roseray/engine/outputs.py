"""What an engine hands out: a step's per-request deltas, a finished request's output, and
the engine's stats."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from roseray.engine.request import Request


@dataclass(slots=True)
class RequestSummary:
    """The parts of a finished request a server reports (what `RequestDelta.request` must
    offer when the Request itself lives in another process)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestDelta:
    """What one engine step produced for one request (what a stream sends)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    new_logprobs: list[dict[int, float]] | None
    num_prompt_tokens: int
    num_output_tokens: int
    request: Request | RequestSummary = field(repr=False)

    @classmethod
    def refused(cls, request_id: str, num_prompt_tokens: int, arrival_time: float) -> RequestDelta:
        """The one delta of a request the engine could not take: finished with reason "error"."""
        return cls(request_id, [], "", True, "error", None, num_prompt_tokens, 0, RequestSummary(arrival_time))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0

    @classmethod
    def from_request(cls, req: Request) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=req.output_text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=req.logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        return cls(req.request_id, req.prompt, req.prompt_token_ids, [completion], req.is_finished,
                   req.num_cached_tokens)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state and counters, as one snapshot. The engine process sends these
    fields in this order (ENGINE_STATS_FIELDS); the async engine's stats add its own."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # where the engine's time goes: its steps, and handing their outputs to the server (only an
    # engine process does that part; an engine in the server's process leaves it 0)
    engine_steps_total: int = 0
    engine_step_seconds_total: float = 0.0
    engine_output_seconds_total: float = 0.0

    @property
    def queue_depth(self) -> int:
        return self.num_running + self.num_waiting

    def values(self) -> list:
        """The fields' values in ENGINE_STATS_FIELDS order (how the wire carries them)."""
        return [getattr(self, name) for name in ENGINE_STATS_FIELDS]


ENGINE_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))
