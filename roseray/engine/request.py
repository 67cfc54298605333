"""A request's state inside the engine: its tokens, progress, status and timestamps."""

from __future__ import annotations

import enum
import time

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

    Three fields belong to the block manager and stay here on purpose: `row` (its row in the
    block-table array while it holds blocks: the key of everything else the block manager
    keeps per request), `num_blocks` and `num_committed_blocks`. The scheduler reads
    `num_blocks` for every running request every step and the engine reads
    `num_committed_blocks` for every sampled token; an attribute is the cheapest read there.
    Likewise `scheduled_step`, `num_pending` and `sample_row` are the step's bookkeeping read
    in the same loops, and `grammar` (a constrained request's matcher) is read per token. The
    block hashes live in the block manager, a seeded generator in the sampler.
    """

    __slots__ = (
        "request_id", "prompt", "prompt_token_ids", "token_ids", "output_token_ids",
        "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens", "sampling_params",
        "status", "row", "num_blocks", "num_committed_blocks", "detokenizer",
        "output_text", "finish_reason", "stop_reason", "logprobs", "cumulative_logprob",
        "arrival_time", "first_scheduled_time", "first_token_time", "last_token_time",
        "finished_time", "num_preemptions", "eos_token_ids", "stop_token_ids", "stop_ids", "max_tokens",
        "scheduled_step", "num_pending", "sample_row", "grammar",
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
        self.grammar = None  # its structured output's matcher (structured_output.RequestGrammar), if constrained

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
