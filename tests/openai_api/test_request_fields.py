"""Request fields (docs/request-fields.md): every field that could change the output is
honoured or refused with a 400 naming it; only fields that cannot change it are ignored;
a field roseray does not know is refused too.

Each request goes both ways into the app: with `content-type: application/json` through the
generation fast path (fast_routes.py), and as `application/vnd.api+json` through FastAPI's
route (the fast path passes other content types on; test_fast_routes.py holds it to that). Served by
uvicorn over random:tiny, greedy unless a case samples."""

import re
from pathlib import Path

import httpx
import pytest

from roseray.config import EngineConfig
from roseray.openai_api.protocol import (
    IGNORED_FIELDS,
    KNOWN_FIELDS,
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
)
from tests.openai_api.helpers import assert_openai_error, serving

DOC = Path(__file__).resolve().parents[2] / "docs" / "request-fields.md"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# the fast path takes application/json only; FastAPI parses any JSON type
PATHS = {"fast path": {"content-type": "application/json"}, "FastAPI": {"content-type": "application/vnd.api+json"}}
BASE = {COMPLETIONS: {"prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        CHAT: {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": 0,
               "ignore_eos": True}}
SAMPLED = {"temperature": 1.0, "seed": 1}
VOCAB = 512  # random:tiny's


@pytest.fixture(scope="module")
def server():
    with serving(EngineConfig(model="random:tiny", num_kv_blocks=64, max_model_len=1024, max_num_seqs=8)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def post(client, route: str, body: dict, way: str) -> httpx.Response:
    return client.post(route, content=httpx.Request("POST", "/", json=body).content, headers=PATHS[way])


def choice(client, route: str, extra: dict, way: str) -> dict:
    response = post(client, route, {**BASE[route], **extra}, way)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def baseline_text(client, route: str = COMPLETIONS) -> str:
    return choice(client, route, {}, "fast path")["text"]


# ---- supported fields change the output -------------------------------------------------------------
def _stop(text: str) -> str:
    return text[2:4]  # ASCII in random:tiny's greedy answer to the baseline prompt


# (route, the request it changes, the field(s) that change it); text: the baseline's text
SUPPORTED = {
    "max_tokens": (COMPLETIONS, lambda text: {}, lambda text: {"max_tokens": 3}),
    "max_completion_tokens": (CHAT, lambda text: {}, lambda text: {"max_completion_tokens": 3}),
    "temperature": (COMPLETIONS, lambda text: {"seed": 1}, lambda text: {"temperature": 1.0}),
    "seed": (COMPLETIONS, lambda text: SAMPLED, lambda text: {"seed": 2}),
    "top_k": (COMPLETIONS, lambda text: SAMPLED, lambda text: {"top_k": 2}),
    "top_p": (COMPLETIONS, lambda text: SAMPLED, lambda text: {"top_p": 0.01}),
    "presence_penalty": (COMPLETIONS, lambda text: {}, lambda text: {"presence_penalty": 2.0}),
    "frequency_penalty": (COMPLETIONS, lambda text: {}, lambda text: {"frequency_penalty": 2.0}),
    "repetition_penalty": (COMPLETIONS, lambda text: {}, lambda text: {"repetition_penalty": 2.0}),
    "stop": (COMPLETIONS, lambda text: {}, lambda text: {"stop": _stop(text)}),
    "include_stop_str_in_output": (COMPLETIONS, lambda text: {"stop": _stop(text)},
                                   lambda text: {"include_stop_str_in_output": True}),
    "min_tokens": (COMPLETIONS, lambda text: {"stop": _stop(text)}, lambda text: {"min_tokens": 6}),
    "logprobs": (COMPLETIONS, lambda text: {}, lambda text: {"logprobs": 1}),
    "top_logprobs": (CHAT, lambda text: {"logprobs": True}, lambda text: {"top_logprobs": 2}),
    "add_generation_prompt": (CHAT, lambda text: {}, lambda text: {"add_generation_prompt": False}),
    "chat_template_kwargs": (CHAT, lambda text: {}, lambda text: {"chat_template_kwargs": {"enable_thinking": False}}),
    "tools": (CHAT, lambda text: {"tool_choice": "none"}, lambda text: {"tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
    # these constrain the output: they hold once the engine enforces structured outputs
    "guided_choice": (COMPLETIONS, lambda text: {}, lambda text: {"guided_choice": ["yes", "no"]}),
    "response_format": (CHAT, lambda text: {}, lambda text: {"response_format": {"type": "json_object"}}),
    "structured_outputs": (COMPLETIONS, lambda text: {}, lambda text: {"structured_outputs": {"regex": "ab+"}}),
}


@pytest.mark.parametrize("way", PATHS)
@pytest.mark.parametrize("field", SUPPORTED)
def test_a_supported_field_changes_the_output(client, field, way):
    route, before, change = SUPPORTED[field]
    text = baseline_text(client)
    assert choice(client, route, before(text), way) != choice(client, route, {**before(text), **change(text)}, way)


@pytest.mark.parametrize("way", PATHS)
def test_stop_token_ids_end_the_output_at_that_token(server, client, way):
    text = baseline_text(client)
    assert text[2] not in text[:2]
    # every id of the third token's text (random:tiny has several ids for some bytes)
    stop_ids = [i for i in range(VOCAB) if server.tokenizer.decode([i]) == text[2]]
    stopped = choice(client, COMPLETIONS, {"stop_token_ids": stop_ids}, way)
    assert stopped["text"] == text[:3] and stopped["finish_reason"] == "stop" and stopped["stop_reason"] in stop_ids


@pytest.mark.parametrize("way", PATHS)
@pytest.mark.parametrize("route,value", [(COMPLETIONS, False), (CHAT, True)])
def test_add_special_tokens_reaches_the_tokenizer(server, client, monkeypatch, way, route, value):
    """random:tiny adds no BOS, so the flag shows in what the tokenizer is asked for."""
    seen, encode = [], server.tokenizer.encode
    monkeypatch.setattr(server.tokenizer, "encode", lambda text, add_special_tokens=True: (
        seen.append(add_special_tokens), encode(text, add_special_tokens))[1])
    choice(client, route, {}, way)
    choice(client, route, {"add_special_tokens": value}, way)
    assert seen == [not value, value]


# ---- ignored fields are accepted and change nothing ----------------------------------------------------
IGNORED = {  # a value of each, as an OpenAI or vLLM client sends it
    "user": "user-1", "metadata": {"team": "a"}, "store": True, "service_tier": "auto", "safety_identifier": "s-1",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "priority": 3, "request_id": "r-1",
    "length_penalty": 0.5,
    "include_obfuscation": None,  # inside stream_options: see below
    "prediction": {"type": "content", "content": "hello"},
}
CHAT_ONLY = set(ChatCompletionRequest.model_fields) - set(CompletionRequest.model_fields)


def test_the_table_covers_every_ignored_field():
    assert set(IGNORED) == IGNORED_FIELDS


@pytest.mark.parametrize("way", PATHS)
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_ignored_fields_are_accepted_and_change_nothing(client, route, way):
    every = {name: value for name, value in IGNORED.items()
             if name != "include_obfuscation" and (route == CHAT or name not in CHAT_ONLY)}
    every["stream_options"] = {"include_usage": True, "include_obfuscation": False}
    assert choice(client, route, every, way) == choice(client, route, {}, way)


# ---- refused fields: 400 naming the field, unless the value changes nothing ------------------------------
REFUSED = {  # field: (a value roseray cannot honour, its neutral value)
    "guided_decoding_backend": ("outlines", "xgrammar"),
    "guided_whitespace_pattern": (" ", None),
    "logit_bias": ({"5": 100}, {}),
    "echo": (True, False),
    "best_of": (2, 1),
    "use_beam_search": (True, False),
    "bad_words": (["x"], []),
    "allowed_token_ids": ([5, 6], []),
    "logits_processors": (["my.module:Processor"], None),
    "prompt_logprobs": (1, None),
    "truncate_prompt_tokens": (4, None),
    "spaces_between_special_tokens": (False, True),
    "return_tokens_as_token_ids": (True, False),
    "return_token_ids": (True, None),
    "cache_salt": ("tenant-a", None),
    "kv_transfer_params": ({"do_remote_prefill": True}, None),
    "vllm_xargs": ({"k": 1}, {}),
    "suffix": ("the end", ""),
    "prompt_embeds": ("AAAA", None),
    "functions": ([{"name": "f"}], None),
    "function_call": ({"name": "f"}, "auto"),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "modalities": (["text", "audio"], ["text"]),
    "reasoning_effort": ("high", None),
    "verbosity": ("low", None),
    "web_search_options": ({}, None),
    "continue_final_message": (True, False),
    "chat_template": ("{{ messages }}", None),
    "documents": ([{"text": "d"}], None),
    "mm_processor_kwargs": ({"fps": 1}, None),
    # keys of the structured_outputs object
    "backend": ("guidance", "auto"),
    "whitespace_pattern": (r"[ ]?", None),
    "disable_additional_properties": (True, False),
}
STRUCTURED_OUTPUTS_FIELDS = {"backend", "whitespace_pattern", "disable_additional_properties"}


def test_the_table_covers_every_refused_field():
    assert set(REFUSED) == set(REFUSED_FIELDS)


def routes_of(field: str) -> list[str]:
    if field in STRUCTURED_OUTPUTS_FIELDS:
        return [COMPLETIONS, CHAT]
    return [route for route, model in ((COMPLETIONS, CompletionRequest), (CHAT, ChatCompletionRequest))
            if field in model.model_fields]


def with_field(route: str, field: str, value) -> dict:
    if field in STRUCTURED_OUTPUTS_FIELDS:
        return {"structured_outputs": {"json_object": True, field: value}}
    return {field: value}


def param_of_field(field: str) -> str:
    return f"structured_outputs.{field}" if field in STRUCTURED_OUTPUTS_FIELDS else field


@pytest.mark.parametrize("way", PATHS)
@pytest.mark.parametrize("field", REFUSED)
def test_a_refused_field_is_400_naming_it(client, field, way):
    for route in routes_of(field):
        body = {**BASE[route], **with_field(route, field, REFUSED[field][0])}
        error = assert_openai_error(post(client, route, body, way), 400)
        assert error["param"] == param_of_field(field) and error["code"] == "unsupported_field", error
        assert error["message"].startswith(f"{field} is not supported (") and "\n" not in error["message"], error


@pytest.mark.parametrize("way", PATHS)
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_the_neutral_value_of_every_refused_field_is_accepted(client, route, way):
    neutral = {field: values[1] for field, values in REFUSED.items()
               if route in routes_of(field) and field not in STRUCTURED_OUTPUTS_FIELDS}
    assert choice(client, route, neutral, way) == choice(client, route, {}, way)


# ---- unknown fields ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("way", PATHS)
@pytest.mark.parametrize("route,extra,param,hint", [
    (COMPLETIONS, {"temprature": 0.5}, "temprature", "did you mean 'temperature'?"),
    (CHAT, {"max_complet_tokens": 3}, "max_complet_tokens", "did you mean 'max_completion_tokens'?"),
    (COMPLETIONS, {"frobnicate": True}, "frobnicate", None),
    (COMPLETIONS, {"tools": []}, "tools", "the other generation route"),  # a chat field, unknown to completions
    (COMPLETIONS, {"stream_options": {"include_usage": True, "usage_every": 2}}, "stream_options.usage_every", None),
])
def test_an_unknown_field_is_400_naming_it(client, route, extra, param, hint, way):
    error = assert_openai_error(post(client, route, {**BASE[route], **extra}, way), 400, param)
    assert error["code"] == "unknown_field" and error["message"].startswith(f"unknown field {param!r}"), error
    assert (hint in error["message"]) if hint else "did you mean" not in error["message"], error
    assert "\n" not in error["message"]


@pytest.mark.parametrize("extra,param,more", [
    ({"max_tokens": "many", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", 1),  # refused first
    ({"temprature": 1.0, "guided_decoding_backend": "outlines"}, "guided_decoding_backend", 1),  # before unknown
    ({"max_tokens": "many", "temprature": 1.0}, "temprature", 1),  # unknown before invalid
    # a refused key of the structured_outputs object, not an invalid structured_outputs
    ({"structured_outputs": {"regex": "a+", "backend": "outlines"}}, "structured_outputs.backend", 0),
])
def test_a_refused_field_is_named_first_then_an_unknown_one(client, extra, param, more):
    error = assert_openai_error(post(client, CHAT, {**BASE[CHAT], **extra}, "fast path"), 400, param)
    assert (f"(and {more} more invalid field(s))" in error["message"]) == bool(more), error


# ---- the list in docs/request-fields.md ------------------------------------------------------------------
def test_the_doc_lists_every_field_in_its_section():
    text = DOC.read_text()
    sections = dict(re.findall(r"^## (\w+).*?\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    listed = lambda name, section: re.search(rf"[`.]{name}`", sections[section]) is not None  # noqa: E731
    supported = KNOWN_FIELDS - IGNORED_FIELDS - set(REFUSED_FIELDS)
    assert [name for name in sorted(supported) if not listed(name, "Supported")] == []
    assert [name for name in sorted(IGNORED_FIELDS) if not listed(name, "Ignored")] == []
    assert [name for name in sorted(REFUSED_FIELDS) if not listed(name, "Refused")] == []
    for section, names in (("Supported", IGNORED_FIELDS | set(REFUSED_FIELDS)), ("Ignored", set(REFUSED_FIELDS))):
        assert [name for name in sorted(names) if listed(name, section)] == [], section
