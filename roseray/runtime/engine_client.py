"""EngineClient: what AsyncLLMEngine drives, whatever the engine runs in.

One class per transport: InProcessEngineClient (the engine on a thread of this process,
in_process_client.py) and EngineProcessClient (the engine in a child process,
process_client.py); make_engine_client (transports.py) picks one. Only the event loop's
thread calls a client. It watches `outputs_fd`, and when that is readable it calls
`read_outputs()`, which returns every delta that arrived since the last call (one or
several engine steps' worth) without waiting. `add_request` checks a request at once
(ValueError says why it can never run) and holds it until `flush_commands()`; an abort or
an integrity check sends the held adds first, so it never overtakes one. KV cache events
(`send_kv_events_request`) are asked for and answered like an integrity check.
"""

from __future__ import annotations

import abc
import itertools
import time
from collections.abc import Callable

from roseray.config import EngineConfig
from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch
from roseray.engine.limits import RequestLimits
from roseray.engine.outputs import EngineStats, RequestDelta
from roseray.engine.structured_output import check_structured_outputs
from roseray.sampling_params import SamplingParams


class EngineError(RuntimeError):
    """The engine failed a step (carries its error's repr) or went away (its process or thread)."""


class EngineClient(abc.ABC):
    """The engine as the async engine and the server see it (see the module docstring)."""

    config: EngineConfig
    tokenizer: object
    model_name: str
    max_model_len: int
    limits: RequestLimits
    # the error of the engine's latest failed step (a new object for each failure), or None
    last_error: BaseException | None
    # called with the seconds from the engine handing a step's outputs over to this client
    # reading them (one time.monotonic() clock for all processes of a host): a reader that
    # falls behind, or waits for its event loop, reads late
    on_message_delay: Callable[[float], None] | None

    def __init__(self, config: EngineConfig, tokenizer, model_name: str, limits: RequestLimits) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits
        self.max_model_len = limits.max_model_len
        self.last_error = None
        self.on_message_delay = None
        self.num_steps_read = 0  # engine steps whose outputs read_outputs() has returned
        self.num_adds_sent = 0  # adds sent to the engine (flush_commands, or before an abort or a check)
        self.num_adds_applied = 0  # of those, the ones the engine had taken as of get_stats()
        self._replies: dict[int, str | None] = {}  # integrity check call id -> what it found wrong, or None
        self._call_ids = itertools.count()  # integrity checks' and KV event requests' call ids
        self._kv_replies: dict[int, KVEventBatch | KVCacheSnapshot] = {}  # KV event request call id -> answer
        # as of the last outputs read; before any, an empty engine of this size
        self._stats = EngineStats(num_free_blocks=limits.num_blocks, num_total_blocks=limits.num_blocks)

    def prepare(self, prompt: str | list[int], sampling_params: SamplingParams) -> list[int]:
        """The prompt's token ids, checked against the engine's limits and its structured output
        against the grammar engine (ValueError if it can never run)."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.limits.check(token_ids, sampling_params)
        if sampling_params.structured_outputs is not None:  # a spec that cannot compile: a 400 here, not in the engine
            check_structured_outputs(sampling_params.structured_outputs)
        return token_ids

    def _admit(self, request_id: str, in_use, prompt: str | list[int], sampling_params: SamplingParams,
               arrival_time: float | None) -> tuple[list[int], float]:
        """An add's checks (a new id, `prepare`): its token ids and arrival time."""
        if request_id in in_use:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.prepare(prompt, sampling_params)
        return token_ids, time.monotonic() if arrival_time is None else arrival_time

    @property
    @abc.abstractmethod
    def outputs_fd(self) -> int:
        """Readable when outputs (deltas, an integrity reply, the engine's end) are waiting."""

    @abc.abstractmethod
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams, *,
                    arrival_time: float | None = None) -> None:
        """Check the request (ValueError) and hold it until flush_commands()."""

    @abc.abstractmethod
    def flush_commands(self) -> int:
        """Send the adds held back as one command; returns how many went."""

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> None:
        """Abort a request (unknown or finished ones are ignored); its last delta says "abort"."""

    @abc.abstractmethod
    def read_outputs(self) -> list[RequestDelta]:
        """Every delta that arrived since the last call, without waiting. Raises EngineError
        when the engine is gone."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Requests added and not yet finished, as far as this side has read."""

    def get_stats(self) -> EngineStats:
        """The engine's stats as of the last outputs read."""
        return self._stats

    @abc.abstractmethod
    def send_integrity_check(self) -> int:
        """Ask for the engine's accounting check between two steps; returns its call id.
        The reply comes with the outputs (integrity_replied, then take_integrity_reply)."""

    def integrity_replied(self, call_id: int) -> bool:
        return call_id in self._replies

    def take_integrity_reply(self, call_id: int) -> None:
        """AssertionError when the check failed."""
        failure = self._replies.pop(call_id)
        if failure is not None:
            raise AssertionError(failure)

    @abc.abstractmethod
    def send_kv_events_request(self, snapshot: bool = False) -> int:
        """Ask for the engine's KV cache events since the last request (a KVEventBatch), or with
        `snapshot` for a KVCacheSnapshot of its prefix cache; returns the call id. The answer
        comes with the outputs (kv_events_replied, then take_kv_events). One consumer per engine."""

    def kv_events_replied(self, call_id: int) -> bool:
        return call_id in self._kv_replies

    def take_kv_events(self, call_id: int) -> KVEventBatch | KVCacheSnapshot:
        return self._kv_replies.pop(call_id)

    @abc.abstractmethod
    def heartbeat(self) -> float:
        """When the engine last showed progress (time.monotonic(); now when it has nothing to do)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine (it finishes the step it is in) and wait for it; may block."""
