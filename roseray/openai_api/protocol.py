"""The OpenAI request bodies roseray accepts (pydantic) and their SamplingParams.

Every field of OpenAI's chat and completions requests and of vLLM's extra parameters is
declared here in one of three kinds (docs/request-fields.md lists them):
- supported: honoured (OpenAI's sampling fields plus vLLM's top_k, min_p, repetition_penalty,
  ignore_eos, stop_token_ids, min_tokens, skip_special_tokens, include_stop_str_in_output,
  add_special_tokens, add_generation_prompt);
- ignored (`_ignored`): accepted and dropped, only where the field cannot change the output
  (user, metadata, store, service_tier, priority, ...);
- refused (`_refused`): roseray cannot honour it, so the schema admits only its neutral
  value (null, false, an empty list, 1, type "text") and anything else is a 400 naming the
  field (errors.py), so that a client never silently gets something else than it asked.
Any other field is refused too (extra="forbid"): a typo of a known field, or a field of a
newer API, is a 400 rather than silently ignored. The fast path (fast_routes.py) validates
with these same models, so both paths apply one rule.

Types are strict, as OpenAI's API is: `"max_tokens": "5"` or `"stream": "yes"` is a 400,
not silently coerced. The numeric ranges are in the fields too (so the OpenAPI schema
states them); SamplingParams checks them again with its own messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from roseray.sampling_params import MAX_LOGPROBS, MAX_PENALTY, MAX_STOP_STRINGS, SamplingParams

_STRICT = ConfigDict(extra="forbid", strict=True)
REFUSED_KEY = "x-roseray-refused"  # in a refused field's schema: why it is refused
IGNORED_KEY = "x-roseray-ignored"  # in an ignored field's schema: true


def _finite(default=None, **bounds):
    """A float field that refuses NaN and +-inf (Python's json module parses both)."""
    return Field(default, allow_inf_nan=False, **bounds)


def _ignored(default=None):
    """A field that cannot change the output: accepted (with its OpenAI or vLLM type) and dropped."""
    return Field(default, description="Accepted and ignored: it cannot change the output.",
                 json_schema_extra={IGNORED_KEY: True})


def _refused(reason: str, default=None):
    """A field roseray cannot honour: its annotation admits only the neutral value."""
    return Field(default, description=f"Not supported ({reason}): only the value that changes nothing is "
                                      "accepted.", json_schema_extra={REFUSED_KEY: reason})


# The sampler works in float32, where a top_p under the smallest normal float32 rounds to 0 and
# would keep no token at all. Any top_p that small means "only the most likely token", which
# this value also means, so it is raised to it.
MIN_TOP_P = 1.1754943508222875e-38  # numpy.finfo(numpy.float32).tiny

StopString = Annotated[str, Field(min_length=1)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenId = Annotated[int, Field(ge=0)]
EmptyList = Annotated[list[Any], Field(max_length=0)]
EmptyObject = Annotated[dict[str, Any], Field(max_length=0)]

_STRUCTURED = "structured output is not implemented"
_TOOLS = "tool calling is not implemented"


class UnsupportedFieldError(ValueError):
    """A request field roseray does not implement; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk
    include_obfuscation: bool | None = _ignored()  # OpenAI's padding of chunks; roseray adds none


class TextResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


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
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = _finite(ge=0.0, le=1.0)
    repetition_penalty: float | None = _finite(gt=0.0, le=MAX_PENALTY)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    # ignored: bookkeeping, caching and scheduling hints that cannot change the output
    user: str | None = _ignored()
    metadata: dict[str, str] | None = _ignored()
    store: bool | None = _ignored()
    service_tier: str | None = _ignored()
    safety_identifier: str | None = _ignored()
    prompt_cache_key: str | None = _ignored()
    prompt_cache_retention: str | None = _ignored()
    priority: int | None = _ignored()  # vLLM: scheduling order only
    request_id: str | None = _ignored()  # vLLM: its own id for the request
    length_penalty: float | None = _ignored()  # vLLM: beam search only, which is refused

    # refused
    logit_bias: EmptyObject | None = _refused("not implemented; an empty object is accepted")
    echo: Literal[False] = _refused("the prompt is not echoed", False)
    best_of: Literal[1] | None = _refused("only 1: one completion per request")
    use_beam_search: Literal[False] = _refused("beam search is not implemented", False)
    response_format: TextResponseFormat | None = _refused(f"only type 'text': {_STRUCTURED}")
    structured_outputs: None = _refused(_STRUCTURED)
    guided_json: None = _refused(_STRUCTURED)
    guided_regex: None = _refused(_STRUCTURED)
    guided_choice: None = _refused(_STRUCTURED)
    guided_grammar: None = _refused(_STRUCTURED)
    structural_tag: None = _refused(_STRUCTURED)
    guided_decoding_backend: None = _refused(_STRUCTURED)
    guided_whitespace_pattern: None = _refused(_STRUCTURED)
    bad_words: EmptyList | None = _refused("not implemented; an empty list is accepted")
    allowed_token_ids: EmptyList | None = _refused("not implemented; an empty list is accepted")
    logits_processors: EmptyList | None = _refused("custom logits processors are not implemented")
    prompt_logprobs: None = _refused("prompt logprobs are not implemented; null is accepted")
    truncate_prompt_tokens: None = _refused("prompts are never truncated")
    spaces_between_special_tokens: Literal[True] = _refused("not implemented; true, the default, is accepted", True)
    return_tokens_as_token_ids: Literal[False] | None = _refused("tokens are returned as text")
    return_token_ids: Literal[False] | None = _refused("token ids are not returned")
    cache_salt: None = _refused("the prefix cache is shared by all requests")
    kv_transfer_params: None = _refused("KV transfer is not implemented")
    vllm_xargs: EmptyObject | None = _refused("no extra arguments are read")

    def _common_params(self) -> dict[str, Any]:
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
    add_special_tokens: bool = True  # vLLM: the tokenizer adds its BOS (if it has one) to a text prompt
    suffix: Literal[""] | None = _refused("insertion is not implemented")
    prompt_embeds: None = _refused("prompt embeddings are not implemented")

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
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs, **self._common_params())


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message. Its other OpenAI fields (tool_call_id, refusal, ...) are accepted and not
    passed to the chat template; an assistant message's tool calls are refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # passed to the chat template (most templates leave it out)
    tool_calls: EmptyList | None = _refused(f"{_TOOLS}; an empty list is accepted")

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
    add_generation_prompt: bool = True  # vLLM extra
    add_special_tokens: bool = False  # vLLM extra: the chat template already holds any BOS the model wants

    parallel_tool_calls: bool | None = _ignored()  # without tools (refused) it changes nothing
    prediction: dict[str, Any] | None = _ignored()  # predicted output: a latency hint, the output is the same
    include_reasoning: bool | None = _ignored()  # vLLM: roseray has no reasoning parser to split text with

    tools: EmptyList | None = _refused(f"{_TOOLS}; an empty list is accepted")
    tool_choice: Literal["none", "auto"] | None = _refused(f"{_TOOLS}; 'none' and 'auto' (without tools) are "
                                                           "accepted")
    functions: EmptyList | None = _refused(_TOOLS)
    function_call: Literal["none", "auto"] | None = _refused(_TOOLS)
    audio: None = _refused("only text output")
    modalities: list[Literal["text"]] | None = _refused("only ['text']")
    reasoning_effort: None = _refused("reasoning controls are not implemented")
    verbosity: None = _refused("verbosity controls are not implemented")
    web_search_options: None = _refused("web search is not implemented")
    continue_final_message: Literal[False] = _refused("the final message is not continued", False)
    chat_template: None = _refused("only the model's own chat template is used")
    chat_template_kwargs: EmptyObject | None = _refused("the chat template takes no extra arguments")
    documents: None = _refused("documents are not passed to the chat template")
    mm_processor_kwargs: None = _refused("only text input")

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them: role, plain-text content and name."""
        return [{"role": m.role, "content": m.text()} if m.name is None
                else {"role": m.role, "content": m.text(), "name": m.name} for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self._common_params())


def _marked(key: str, *models: type[BaseModel]) -> dict[str, Any]:
    """The fields of `models` whose schema holds `key`, with its value."""
    return {name: field.json_schema_extra[key] for model in models for name, field in model.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and key in field.json_schema_extra}


# field name -> why roseray refuses it (errors.py words a refused field's 400 with it)
REFUSED_FIELDS: dict[str, str] = _marked(REFUSED_KEY, CompletionRequest, ChatCompletionRequest, ChatMessage)
IGNORED_FIELDS: frozenset[str] = frozenset(_marked(IGNORED_KEY, CompletionRequest, ChatCompletionRequest,
                                                   StreamOptions))
# every field a generation request may name, on either route (for "did you mean" hints)
KNOWN_FIELDS: frozenset[str] = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
