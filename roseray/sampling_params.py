"""SamplingParams: how to sample one request (vLLM's field names), validated on creation;
StructuredOutputs: the grammar a request's output must follow."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # most top logprobs a request may ask for per token
MAX_STOP_STRINGS = 16
MAX_PENALTY = 2.0  # presence/frequency in [-MAX_PENALTY, MAX_PENALTY], repetition in (0, MAX_PENALTY]


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A constraint on the output, as text (so it hashes, caches and travels as JSON):

    - `json`: `spec` is a JSON schema, as JSON text; `json_object`: any JSON object (`spec` "")
    - `regex`: a regular expression the whole output matches
    - `choice`: a JSON list of strings, the output is exactly one of them
    - `grammar`: an EBNF grammar (GBNF, as vLLM's xgrammar backend takes it), `root` first
    - `structural_tag`: a structural tag, as JSON text (xgrammar's format)

    `any_whitespace` (json, json_object): JSON may put any whitespace between tokens (up to a
    bound); False: none, the compact form (vLLM's disable_any_whitespace). Whether the spec
    compiles is checked by roseray.engine.structured_output, not here.
    """

    kind: str
    spec: str = ""
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string, got {type(self.spec).__name__}")
        if not isinstance(self.any_whitespace, bool):
            raise ValueError(f"structured output any_whitespace must be a bool, got {self.any_whitespace!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output of kind {self.kind!r} needs a spec")

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutputs:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def json_schema(cls, schema: dict | str, any_whitespace: bool = True) -> StructuredOutputs:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema), any_whitespace)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None  # normalised to a list (empty when None)
    stop_token_ids: list[int] | None = None  # normalised to a list (empty when None)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # a grammar the output follows (a dict of its fields is taken too: the engine process's messages)
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got {self.structured_outputs!r}")
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured outputs: the grammar decides where "
                             "the output ends")
        self._validate_numbers()
        self._validate_lengths()
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _validate_numbers(self) -> None:
        _check_int("n", self.n)
        if self.n != 1:
            raise ValueError(f"n must be 1 (only one completion per request is supported), got {self.n}")
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= MAX_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_PENALTY}], got {self.repetition_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be None or >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    @property
    def is_greedy(self) -> bool:
        """Sampling reduces to argmax: temperature 0, or only the top token is allowed."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def is_plain_greedy(self) -> bool:
        """An argmax of the raw logits is the whole of this request's sampling, at every step."""
        return (self.is_greedy and not self.needs_penalties and self.logprobs is None and self.min_tokens == 0
                and self.structured_outputs is None)

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
    return list(stop)


def _normalise_stop_token_ids(stop_token_ids: object) -> list[int]:
    if stop_token_ids is None:
        return []
    if not isinstance(stop_token_ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {stop_token_ids!r}")
    for token_id in stop_token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {token_id!r}")
    return list(stop_token_ids)
