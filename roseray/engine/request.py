"""A request's state inside the engine: its tokens, progress, status and timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from roseray.sampling_params import SamplingParams

PLACEHOLDER = -1  # a token id the device has sampled but the host has not seen yet


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 3  # max_tokens or max_model_len
    FINISHED_ABORTED = 4  # the client went away or abort() was called
    FINISHED_ERROR = 5  # the engine step failed

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated.

    `token_ids` holds prompt + output; `num_computed_tokens` of them have K/V in the
    cache. A request in decode has exactly one token not yet computed (the last sampled).
    `row` is its row in the block manager's block-table array while it holds blocks.
    """

    __slots__ = (
        "request_id", "prompt", "prompt_token_ids", "token_ids", "output_token_ids",
        "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens", "sampling_params",
        "status", "row", "num_blocks", "num_committed_blocks", "block_hashes", "generator", "detokenizer",
        "output_text", "finish_reason", "stop_reason", "logprobs", "cumulative_logprob",
        "arrival_time", "first_scheduled_time", "first_token_time", "last_token_time",
        "finished_time", "num_preemptions", "eos_token_ids", "stop_token_ids", "stop_ids", "max_tokens",
        "scheduled_step", "num_pending", "sample_row",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        max_tokens: int,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.sampling_params = sampling_params
        self.status = RequestStatus.WAITING
        self.row = -1
        self.num_blocks = 0
        self.num_committed_blocks = 0  # leading full blocks already published in the prefix cache
        self.block_hashes: list[int] = []  # hashes of this request's full blocks, in order
        self.generator = None  # torch.Generator for seeded sampling, made by the sampler
        self.detokenizer = None
        self.output_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.stop_ids = self.eos_token_ids | self.stop_token_ids  # a token that may end the request
        self.max_tokens = max_tokens
        self.scheduled_step = -1  # the scheduler step that last scheduled this request
        self.num_pending = 0  # trailing tokens still being sampled on the device (PLACEHOLDER in token_ids)
        self.sample_row = -1  # row of this request in the in-flight step's sampled ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.num_blocks})")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What an engine can take; checks a request before it is queued (the engine and the
    engine-process client run the same checks, so both refuse with the same message)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    num_blocks: int
    block_size: int

    def check(self, token_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError for a request that is invalid or can never fit; returns its max_tokens."""
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt ({len(token_ids)} tokens) leaves no room for output within "
                             f"max_model_len ({self.max_model_len})")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise ValueError(f"logprobs must be at most {self.max_logprobs}, got {params.logprobs}")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(token_ids)
        total = len(token_ids) + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                             f"exceeds max_model_len ({self.max_model_len})")
        capacity = self.num_blocks * self.block_size  # whole blocks: fits iff its blocks do
        if total > capacity:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) = {total} tokens can "
                             f"never fit in the KV cache ({capacity} tokens)")
        return max_tokens


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
