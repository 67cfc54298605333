"""The OpenAI request bodies roseray accepts (pydantic) and their SamplingParams.

Field names are OpenAI's, plus vLLM's common extras (top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, min_tokens, skip_special_tokens, include_stop_str_in_output).
Unknown fields are ignored, as vLLM does; fields whose meaning roseray cannot honour
(n > 1, best_of, echo, suffix, tools, logit_bias, non-text content) are rejected with a
message naming the field, so a client never silently gets something else than it asked.

Types are strict, as OpenAI's API is: `"max_tokens": "5"` or `"stream": "yes"` is a 400,
not silently coerced. The numeric ranges are in the fields too (so the OpenAPI schema
states them); SamplingParams checks them again with its own messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from roseray.sampling_params import MAX_LOGPROBS, MAX_PENALTY, MAX_STOP_STRINGS, SamplingParams

_STRICT = ConfigDict(extra="ignore", strict=True)


def _finite(default=None, **bounds):
    """A float field that refuses NaN and +-inf (Python's json module parses both)."""
    return Field(default, allow_inf_nan=False, **bounds)


# The sampler works in float32, where a top_p under the smallest normal float32 rounds to 0 and
# would keep no token at all. Any top_p that small means "only the most likely token", which
# this value also means, so it is raised to it (see the report of issue 6 for the engine fix).
MIN_TOP_P = 1.1754943508222875e-38  # numpy.finfo(numpy.float32).tiny

StopString = Annotated[str, Field(min_length=1)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenId = Annotated[int, Field(ge=0)]


class UnsupportedFieldError(ValueError):
    """A request field roseray does not implement; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    temperature: float | None = _finite(ge=0.0)
    top_p: float | None = _finite(gt=0.0, le=1.0)
    stop: StopString | StopList | None = None
    presence_penalty: float | None = _finite(ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = _finite(ge=-MAX_PENALTY, le=MAX_PENALTY)
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = _finite(ge=0.0, le=1.0)
    repetition_penalty: float | None = _finite(gt=0.0, le=MAX_PENALTY)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def _common_params(self) -> dict[str, Any]:
        if self.logit_bias:
            raise UnsupportedFieldError("logit_bias", "logit_bias is not supported")
        params: dict[str, Any] = dict(
            n=self.n, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids, min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:  # None = the SamplingParams default
                params[name] = max(value, MIN_TOP_P) if name == "top_p" else value
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; batched prompts are refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise UnsupportedFieldError("prompt", f"batched prompts are not supported: send one prompt "
                                                      f"per request (got {len(prompt)})")
            prompt = prompt[0]
        if not prompt:
            raise UnsupportedFieldError("prompt", "the prompt is empty")
        return prompt

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise UnsupportedFieldError("echo", "echo is not supported")
        if self.suffix:
            raise UnsupportedFieldError("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedFieldError("best_of", "best_of must be 1")
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs, **self._common_params())


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise UnsupportedFieldError("messages", f"only text content is supported (got a {part.type!r} part)")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM extra

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them: role and plain-text content."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        if self.tools:
            raise UnsupportedFieldError("tools", "tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise UnsupportedFieldError("response_format", "only response_format type 'text' is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self._common_params())
