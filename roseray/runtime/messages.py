"""The engine process's messages: one typed class per kind, encoded and decoded here only.

On the wire a message is a JSON array, its kind then its fields in the class's order
(`[kind, field, ...]`), framed as multiprocessing.connection frames it (a 4-byte length,
then the bytes); no pickle. The first message on the first client's command pipe is
`Start` (the engine config); then

    client -> engine   AddRequests | AbortRequest | CheckIntegrity | GetKVEvents | Stop
    engine -> client   Ready | StartFailed                      (once, at start)
                       StepOutputs                               (after every step with requests)
                       IntegrityReply | KVEventsReply            (to the client that asked)
                       EngineFailed                              (once, when the engine ends on an error)

KV cache events (GetKVEvents) have one consumer per engine: each drain hands the events
since the previous one to whoever asked, so a second consumer would split the stream (a
Ray replica's own client asks, for the Router; API processes never do).

Each client's count of adds the engine has taken travels with the stats, so that a client
knows which of its adds the stats already show (the queue limit counts the others).

`StepOutputs` is the hot one: one per engine step, encoded once and sent to every client
that had a request in it. It is columnar (one list per field: request ids, token ids,
texts, output counts) so that a step of many deltas costs a few list builds and one
`json` call rather than an object per delta; a delta of exactly one token sends it bare
(flat ints encode faster than one-element lists). The rare parts (a finished request's
summary, logprobs) go in two short lists keyed by the delta's index. Sampling parameters
travel as the fields that differ from SamplingParams' defaults.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

from roseray.config import EngineConfig
from roseray.engine.kv_events import KVCacheSnapshot, KVEventBatch
from roseray.engine.limits import RequestLimits
from roseray.engine.outputs import EngineStats, RequestDelta
from roseray.sampling_params import SamplingParams

_encode_json = json.JSONEncoder(separators=(",", ":")).encode
# the defaults as a SamplingParams holds them (normalised: stop=None becomes [])
_SAMPLING_DEFAULTS = tuple((f.name, getattr(SamplingParams(), f.name)) for f in dataclasses.fields(SamplingParams))


def _dumps(message: list) -> bytes:
    return _encode_json(message).encode()


def sampling_overrides(params: SamplingParams) -> dict:
    """The fields of `params` that differ from SamplingParams' defaults (a constraint as a dict of its fields)."""
    overrides = {name: value for name, default in _SAMPLING_DEFAULTS if (value := getattr(params, name)) != default}
    if params.structured_outputs is not None:
        overrides["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    return overrides


# ---- client -> engine ------------------------------------------------------------------------
@dataclass(slots=True)
class Start:
    """The engine config, first on the first client's command pipe."""

    config: EngineConfig

    def encode(self) -> bytes:
        return _dumps(["start", dataclasses.asdict(self.config)])

    @classmethod
    def from_fields(cls, config: dict) -> Start:
        return cls(EngineConfig(**config))


@dataclass(slots=True)
class AddRequests:
    """New requests of one client, by their handles (the client's names for them), columnar."""

    handles: list[str]
    token_ids: list[list[int]]
    params: list[SamplingParams]
    arrival_times: list[float]

    def encode(self) -> bytes:
        return _dumps(["add", self.handles, self.token_ids, [sampling_overrides(p) for p in self.params],
                       self.arrival_times])

    @classmethod
    def from_fields(cls, handles, token_ids, params, arrival_times) -> AddRequests:
        return cls(handles, token_ids, [SamplingParams(**overrides) for overrides in params], arrival_times)


@dataclass(slots=True)
class AbortRequest:
    handle: str

    def encode(self) -> bytes:
        return _dumps(["abort", self.handle])

    @classmethod
    def from_fields(cls, handle) -> AbortRequest:
        return cls(handle)


@dataclass(slots=True)
class CheckIntegrity:
    """Run the engine's accounting check between two steps; answered by IntegrityReply."""

    call_id: int

    def encode(self) -> bytes:
        return _dumps(["check_integrity", self.call_id])

    @classmethod
    def from_fields(cls, call_id) -> CheckIntegrity:
        return cls(call_id)


@dataclass(slots=True)
class GetKVEvents:
    """Drain the engine's KV cache events between two steps, or (`snapshot`) take a snapshot of
    its whole prefix cache instead; answered by KVEventsReply."""

    call_id: int
    snapshot: bool

    def encode(self) -> bytes:
        return _dumps(["kv_events", self.call_id, self.snapshot])

    @classmethod
    def from_fields(cls, call_id, snapshot) -> GetKVEvents:
        return cls(call_id, bool(snapshot))


@dataclass(slots=True)
class Stop:
    """The client is done: its requests are aborted; the engine exits with its last client."""

    def encode(self) -> bytes:
        return _dumps(["stop"])

    @classmethod
    def from_fields(cls) -> Stop:
        return cls()


# ---- engine -> client ------------------------------------------------------------------------
@dataclass(slots=True)
class Ready:
    """The engine is loaded. `client_index`: this client's place in StepOutputs.adds_applied;
    `client_prefix`: what the engine puts before this client's handles to name its requests
    (in StepOutputs too); "" when it has one client."""

    model_name: str
    limits: RequestLimits
    pid: int
    client_index: int
    client_prefix: str

    def encode(self) -> bytes:
        return _dumps(["ready", self.model_name, dataclasses.asdict(self.limits), self.pid, self.client_index,
                       self.client_prefix])

    @classmethod
    def from_fields(cls, model_name, limits, pid, client_index, client_prefix) -> Ready:
        return cls(model_name, RequestLimits(**limits), pid, client_index, client_prefix)


@dataclass(slots=True)
class StartFailed:
    """The engine could not start; the client raises `error_type` (ValueError or not) with `message`."""

    error_type: str
    message: str

    def encode(self) -> bytes:
        return _dumps(["failed", self.error_type, self.message])

    @classmethod
    def from_fields(cls, error_type, message) -> StartFailed:
        return cls(error_type, message)


@dataclass(slots=True)
class EngineFailed:
    """The engine ended on an error it cannot step past (a tensor-parallel rank exited); the
    client raises EngineError with `message` (the error's repr), and the engine process exits."""

    message: str

    def encode(self) -> bytes:
        return _dumps(["engine_failed", self.message])

    @classmethod
    def from_fields(cls, message) -> EngineFailed:
        return cls(message)


@dataclass(slots=True)
class StepOutputs:
    """One engine step's deltas, columnar, named by their request ids in the engine.

    `finished`: [index, finish_reason, first_scheduled_time, num_cached_tokens, stop_reason]
    for each delta that finished; `logprobs`: [index, [[token_id, logprob], ...] per new
    token] for each delta that carries them. `adds_applied`: each client's count of adds the
    engine has taken so far (by client index), as of `stats`. `error`: the repr of the
    engine's error when this step failed (once per error). `sent_at`: the engine's
    time.monotonic() when it was encoded (one clock for every process of a host)."""

    request_ids: list[str]
    token_ids: list[int | list[int]]  # a bare int: the delta's one token
    texts: list[str]
    num_output_tokens: list[int]
    finished: list[list]
    logprobs: list[list]
    stats: EngineStats
    adds_applied: list[int]
    error: str | None
    sent_at: float

    @classmethod
    def from_deltas(cls, deltas: list[RequestDelta], stats: EngineStats, adds_applied: list[int],
                    error: str | None = None) -> StepOutputs:
        finished, logprobs = [], []
        for index, delta in enumerate(deltas):
            if delta.finished or delta.new_logprobs is not None:  # the rare parts: one test for the common delta
                if delta.finished:
                    req = delta.request
                    finished.append([index, delta.finish_reason, req.first_scheduled_time, req.num_cached_tokens,
                                     req.stop_reason])
                if delta.new_logprobs is not None:
                    logprobs.append([index, [list(entry.items()) for entry in delta.new_logprobs]])
        return cls([d.request_id for d in deltas],
                   [d.new_token_ids[0] if len(d.new_token_ids) == 1 else d.new_token_ids for d in deltas],
                   [d.new_text for d in deltas], [d.num_output_tokens for d in deltas], finished, logprobs,
                   stats, adds_applied, error, time.monotonic())

    def encode(self) -> bytes:
        return _dumps(["step", self.request_ids, self.token_ids, self.texts, self.num_output_tokens, self.finished,
                       self.logprobs, self.stats.values(), self.adds_applied, self.error, self.sent_at])

    @classmethod
    def from_fields(cls, request_ids, token_ids, texts, num_output_tokens, finished, logprobs, stats, adds_applied,
                    error, sent_at) -> StepOutputs:
        return cls(request_ids, token_ids, texts, num_output_tokens, finished, logprobs, EngineStats(*stats),
                   adds_applied, error, sent_at)


@dataclass(slots=True)
class IntegrityReply:
    """The answer to CheckIntegrity: None, or what the check found wrong; with the stats and
    the asking client's count of adds the engine has taken."""

    call_id: int
    failure: str | None
    stats: EngineStats
    adds_applied: int

    def encode(self) -> bytes:
        return _dumps(["reply", self.call_id, self.failure, self.stats.values(), self.adds_applied])

    @classmethod
    def from_fields(cls, call_id, failure, stats, adds_applied) -> IntegrityReply:
        return cls(call_id, failure, EngineStats(*stats), adds_applied)


@dataclass(slots=True)
class KVEventsReply:
    """The answer to GetKVEvents: the batch drained, or the snapshot taken."""

    call_id: int
    events: KVEventBatch | KVCacheSnapshot

    def encode(self) -> bytes:
        kind = "snapshot" if isinstance(self.events, KVCacheSnapshot) else "batch"
        return _dumps(["kv_reply", self.call_id, kind, self.events.to_dict()])

    @classmethod
    def from_fields(cls, call_id, kind, events) -> KVEventsReply:
        return cls(call_id, (KVCacheSnapshot if kind == "snapshot" else KVEventBatch).from_dict(events))


Message = (Start | AddRequests | AbortRequest | CheckIntegrity | GetKVEvents | Stop | Ready | StartFailed
           | EngineFailed | StepOutputs | IntegrityReply | KVEventsReply)
_KINDS = {"start": Start, "add": AddRequests, "abort": AbortRequest, "check_integrity": CheckIntegrity,
          "kv_events": GetKVEvents, "stop": Stop, "ready": Ready, "failed": StartFailed,
          "engine_failed": EngineFailed, "step": StepOutputs, "reply": IntegrityReply, "kv_reply": KVEventsReply}


def decode(data: bytes) -> Message:
    """The message `data` encodes (ValueError for bytes that are not one)."""
    kind, *fields = json.loads(data)
    message_class = _KINDS.get(kind)
    if message_class is None:
        raise ValueError(f"not an engine message: {kind!r}")
    return message_class.from_fields(*fields)
