"""The OpenAI request bodies roseray accepts (pydantic) and their SamplingParams.

Every field of OpenAI's chat and completions requests and of vLLM's extra parameters is
declared here in one of three kinds (docs/request-fields.md lists them):
- supported: honoured (OpenAI's sampling fields plus vLLM's top_k, min_p, repetition_penalty,
  ignore_eos, stop_token_ids, min_tokens, skip_special_tokens, include_stop_str_in_output,
  add_special_tokens, add_generation_prompt; the output's constraint: response_format,
  structured_outputs and vLLM's guided_* names (constraints.py); function tools and
  tool_choice (tools.py); chat_template_kwargs and include_reasoning);
- ignored (`_ignored`): accepted and dropped, only where the field cannot change the output
  (user, metadata, store, service_tier, priority, ...);
- refused (`_refused`): roseray cannot honour it, so the schema admits only its neutral
  value (null, false, an empty list, 1, "auto") and anything else is a 400 naming the
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

from roseray.openai_api.constraints import (
    BACKEND_REASON,
    Backend,
    Choices,
    Constraint,
    ResponseFormat,
    Spec,
    StructuredOutputsObject,
    request_constraint,
)
from roseray.openai_api.field_policy import IGNORED_KEY, REFUSED_KEY, UnsupportedFieldError
from roseray.openai_api.field_policy import ignored as _ignored
from roseray.openai_api.field_policy import refused as _refused
from roseray.openai_api.tools import NO_TOOLS, AssistantToolCall, Tool, ToolChoice, ToolPlan, plan_tools
from roseray.sampling_params import MAX_LOGPROBS, MAX_PENALTY, MAX_STOP_STRINGS, SamplingParams

__all__ = ["UnsupportedFieldError", "REFUSED_FIELDS", "IGNORED_FIELDS", "KNOWN_FIELDS"]
_STRICT = ConfigDict(extra="forbid", strict=True)


def _finite(default=None, **bounds):
    """A float field that refuses NaN and +-inf (Python's json module parses both)."""
    return Field(default, allow_inf_nan=False, **bounds)


# The sampler works in float32, where a top_p under the smallest normal float32 rounds to 0 and
# would keep no token at all. Any top_p that small means "only the most likely token", which
# this value also means, so it is raised to it.
MIN_TOP_P = 1.1754943508222875e-38  # numpy.finfo(numpy.float32).tiny

StopString = Annotated[str, Field(min_length=1)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenId = Annotated[int, Field(ge=0)]
EmptyList = Annotated[list[Any], Field(max_length=0)]
EmptyObject = Annotated[dict[str, Any], Field(max_length=0)]

_FUNCTIONS = "the deprecated functions API is not implemented: send tools and tool_choice"


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk
    include_obfuscation: bool | None = _ignored()  # OpenAI's padding of chunks; roseray adds none


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
    # the output's constraint (constraints.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsObject | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Spec | None = None
    guided_choice: Choices | None = None
    guided_grammar: Spec | None = None
    structural_tag: Spec | None = None
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
    guided_decoding_backend: Backend | None = _refused(BACKEND_REASON)
    guided_whitespace_pattern: None = _refused("the JSON grammar's whitespace is fixed")

    def constraint(self) -> Constraint | None:
        """The request's constraint on the output (a 400 when it names more than one)."""
        return request_constraint(self)

    def _common_params(self, constraint: Constraint | None) -> dict[str, Any]:
        params: dict[str, Any] = dict(
            structured_outputs=constraint.structured_outputs if constraint is not None else None,
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
        return SamplingParams(max_tokens=self.max_tokens, logprobs=self.logprobs,
                              **self._common_params(self.constraint()))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message. Role, text content, name, an assistant's tool calls, a tool result's
    tool_call_id and an assistant's earlier reasoning_content reach the chat template; its
    other OpenAI fields (refusal, ...) are accepted and left out."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # passed to the chat template (most templates leave it out)
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls (the conversation's history)
    tool_call_id: str | None = None  # a tool message: the call it answers

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

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = (self.model_extra or {}).get("reasoning_content")
        if isinstance(reasoning, str):
            message["reasoning_content"] = reasoning
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM extra
    add_special_tokens: bool = False  # vLLM extra: the chat template already holds any BOS the model wants
    # function tools (tools.py): rendered by the chat template; tool_choice says what becomes of them
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a required choice makes one call
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: more variables of the chat template
    include_reasoning: bool | None = None  # vLLM: false leaves the reasoning out of the response

    prediction: dict[str, Any] | None = _ignored()  # predicted output: a latency hint, the output is the same

    functions: EmptyList | None = _refused(_FUNCTIONS)
    function_call: Literal["none", "auto"] | None = _refused(_FUNCTIONS)
    audio: None = _refused("only text output")
    modalities: list[Literal["text"]] | None = _refused("only ['text']")
    reasoning_effort: None = _refused("reasoning controls are not implemented")
    verbosity: None = _refused("verbosity controls are not implemented")
    web_search_options: None = _refused("web search is not implemented")
    continue_final_message: Literal[False] = _refused("the final message is not continued", False)
    chat_template: None = _refused("only the model's own chat template is used")
    documents: None = _refused("documents are not passed to the chat template")
    mm_processor_kwargs: None = _refused("only text input")

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them (ChatMessage.for_template)."""
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as HF chat templates take them: OpenAI's shape."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True, by_alias=True) for tool in self.tools]

    def to_sampling_params(self, tool_call_parser: str | None = None) -> SamplingParams:
        return self.plan(tool_call_parser)[0]

    def plan(self, tool_call_parser: str | None = None) -> tuple[SamplingParams, ToolPlan, Constraint | None]:
        """The request's SamplingParams, what becomes of its tools and its constraint (the
        tools' grammar, for a required or named tool_choice)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedFieldError("top_logprobs", "top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        constraint = self.constraint()
        tool_plan, constraint = (NO_TOOLS, constraint) if self.tools is None and self.tool_choice is None else \
            plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, tool_call_parser, constraint)
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self._common_params(constraint))
        return params, tool_plan, constraint


def _marked(key: str, *models: type[BaseModel]) -> dict[str, Any]:
    """The fields of `models` whose schema holds `key`, with its value."""
    return {name: field.json_schema_extra[key] for model in models for name, field in model.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and key in field.json_schema_extra}


# field name -> why roseray refuses it (errors.py words a refused field's 400 with it)
REFUSED_FIELDS: dict[str, str] = _marked(REFUSED_KEY, CompletionRequest, ChatCompletionRequest, ChatMessage,
                                         StructuredOutputsObject)
IGNORED_FIELDS: frozenset[str] = frozenset(_marked(IGNORED_KEY, CompletionRequest, ChatCompletionRequest,
                                                   StreamOptions))
# every field a generation request may name, on either route (for "did you mean" hints)
KNOWN_FIELDS: frozenset[str] = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
