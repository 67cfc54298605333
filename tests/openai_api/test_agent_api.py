"""The agent API over HTTP (docs/agent-api.md): structured outputs, tool calls and the
request fields around them, through the official `openai` client and raw HTTP, against a
server of random:tiny with the hermes tool-call parser.

With random weights only the grammar makes an output valid, so every validity check here
is a check of the engine's enforcement. Greedy and sampled requests both; bounded strings
and arrays keep outputs short."""

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from roseray.config import EngineConfig
from roseray.openai_api.constraints import _schema_problem, check_schema
from roseray.openai_api.field_policy import UnsupportedFieldError
from roseray.openai_api.protocol import ChatCompletionRequest
from tests.openai_api.helpers import assert_openai_error, serving, sse_events

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_TOKENS = 300
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: an empty arguments object
TOOLS = [WEATHER, CLOCK, PING]
PARAMETERS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object", "properties": {}})
              for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}]


class City(BaseModel):
    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=10_000_000)
    coastal: bool


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(model="random:tiny", num_kv_blocks=256, max_model_len=2048, max_num_seqs=8)
    with serving(config, tool_call_parser="hermes") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(http, **fields) -> httpx.Response:
    return http.post(CHAT, json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, **fields})


def assert_valid_calls(calls, names=None, at_most=None) -> None:
    assert calls and (at_most is None or len(calls) <= at_most), calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in (names or PARAMETERS), call
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def streamed_calls(chunks) -> list:
    """The calls of a streamed response, checking OpenAI's delta rules: a call's first delta has
    its id, type and name, the later ones only arguments pieces."""
    calls = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and delta.function.name, delta
                calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                      "arguments": delta.function.arguments or ""}
            else:
                assert delta.id is None and delta.function.name is None, delta
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for _, c in sorted(calls.items())]


# ---- the openai client ------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", SAMPLING)
def test_parse_returns_the_pydantic_object(client, sampling):
    completion = client.chat.completions.parse(model="random:tiny", messages=MESSAGES, response_format=City,
                                               max_tokens=MAX_TOKENS, **sampling)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City), choice.message


# parallel calls: greedy random weights may add calls to the list until max_tokens, so that one samples
@pytest.mark.parametrize("parallel,sampling", [(False, SAMPLING[0]), (False, SAMPLING[1]), (True, SAMPLING[1])])
def test_required_tool_choice_returns_valid_calls(client, sampling, parallel):
    completion = client.chat.completions.create(model="random:tiny", messages=MESSAGES, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=parallel,
                                                max_tokens=MAX_TOKENS, **sampling)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert_valid_calls(choice.message.tool_calls, at_most=None if parallel else 1)


@pytest.mark.parametrize("sampling", SAMPLING)
def test_required_tool_choice_streams_valid_calls(client, sampling):
    chunks = list(client.chat.completions.create(model="random:tiny", messages=MESSAGES, tools=TOOLS,
                                                 tool_choice="required", parallel_tool_calls=False,
                                                 max_tokens=MAX_TOKENS, stream=True, **sampling))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert_valid_calls(streamed_calls(chunks), at_most=1)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["get_weather", "ping"])
def test_a_named_tool_choice_returns_that_call(client, stream, name):
    response = client.chat.completions.create(model="random:tiny", messages=MESSAGES, tools=TOOLS,
                                              tool_choice={"type": "function", "function": {"name": name}},
                                              max_tokens=MAX_TOKENS, stream=stream, temperature=1.0, seed=3)
    if stream:
        chunks = list(response)
        calls, finish = streamed_calls(chunks), chunks[-1].choices[0].finish_reason
    else:
        calls, finish = response.choices[0].message.tool_calls, response.choices[0].finish_reason
    assert finish == "tool_calls"
    assert len(calls) == 1
    assert_valid_calls(calls, names={name})


def test_auto_tool_choice_parses_the_output_with_the_servers_parser(client, http):
    """The random model writes no <tool_call>: the answer is its text, as content."""
    completion = client.chat.completions.create(model="random:tiny", messages=MESSAGES, tools=TOOLS,
                                                max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    plain = chat(http, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0, ignore_eos=True).json()
    assert choice.message.content == plain["choices"][0]["message"]["content"]
    chunks = list(client.chat.completions.create(model="random:tiny", messages=MESSAGES, tools=TOOLS, stream=True,
                                                 max_tokens=12, temperature=0, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


# ---- constraints --------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
    "level": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"enum": ["low", "high"]}]},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}},
    "required": ["tags", "level", "inner"], "additionalProperties": False}


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("route,fields", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}),
    (CHAT, {"structured_outputs": {"json": SCHEMA}}),
    (COMPLETIONS, {"structured_outputs": {"json": json.dumps(SCHEMA)}}),
    (COMPLETIONS, {"guided_json": SCHEMA}),
])
def test_json_schema_outputs_validate(http, route, fields, sampling):
    body = {"prompt": "data:"} if route == COMPLETIONS else {"messages": MESSAGES}
    response = http.post(route, json={**body, **fields, "max_tokens": MAX_TOKENS, **sampling})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["text"] if route == COMPLETIONS else choice["message"]["content"]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields,valid", [
    ({"structured_outputs": {"regex": "[a-c]{2,5}x[0-9]"}}, lambda t: re.fullmatch("[a-c]{2,5}x[0-9]", t)),
    ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["0", "1"]}, lambda t: t in ("0", "1")),
    ({"structured_outputs": {"grammar": 'root ::= "n=" [0-9] [0-9]?'}}, lambda t: re.fullmatch("n=[0-9]{1,2}", t)),
    ({"guided_grammar": 'root ::= ("ab" | "cd")+ "."'}, lambda t: re.fullmatch("(ab|cd)+[.]", t)),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"k": {"enum": ["v"]}}, "required": ["k"],
                                      "additionalProperties": False}, "disable_any_whitespace": True}},
     lambda t: t == '{"k": "v"}'),  # no free whitespace: the fixed separators only
])
def test_regex_choice_and_grammar_outputs_match(http, fields, valid, stream):
    response = http.post(COMPLETIONS, json={"prompt": "answer:", "max_tokens": MAX_TOKENS, "temperature": 1.0,
                                            "seed": 11, "stream": stream, **fields})
    assert response.status_code == 200, response.text
    if stream:
        events = sse_events(response.text)
        text, finish = "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]
    else:
        choice = response.json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    assert finish == "stop" and valid(text), (text, finish)


# ---- bad input: 400 in the OpenAI shape, naming the field --------------------------------------------------
def with_tools(tools, choice="required"):
    return {"tools": tools, "tool_choice": choice}


BAD_TOOL = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {
    "a": {"type": "string"}, "b": {"type": "string"}}, "dependentRequired": {"a": ["b"]}}}}


@pytest.mark.parametrize("fields,param,words", [
    # what the backend cannot enforce: the engine's message names the construct
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
        "dependentRequired": {"a": ["b"]}}}}}, "response_format", "dependentRequired"),
    (with_tools([BAD_TOOL]), "tools", "dependentRequired"),
    ({"guided_regex": "(ab"}, "guided_regex", None),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", None),
    ({"guided_grammar": "root ::= "}, "guided_grammar", None),
    # what the server checks itself
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integr"}}}},
     "response_format", "invalid JSON schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {}}, "structured_outputs", "names no constraint"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "response_format and"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "both constrain"),
    ({**with_tools(TOOLS), "guided_choice": ["a"]}, "tool_choice", "guided_choice and tool_choice"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "min_tokens"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "needs tools"),
    (with_tools(TOOLS, {"type": "function", "function": {"name": "get_wether"}}), "tool_choice", "'get_wether'"),
    (with_tools([WEATHER, WEATHER]), "tools", "more than one function"),
    (with_tools([{"type": "function", "function": {"description": "no name"}}]), "tools.0.function.name",
     "missing"),
    (with_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
     "tools.0.function.parameters", "invalid JSON schema"),
    (with_tools(TOOLS, "none") | {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
])
def test_bad_agent_input_is_a_400_naming_the_field(http, fields, param, words):
    error = assert_openai_error(chat(http, **{"max_tokens": 4, **fields}), 400, param)
    assert words is None or words in error["message"], error


def test_a_schema_checked_before_is_judged_alike_and_each_error_names_its_own_field():
    for param in ("response_format", "tools.0.function.parameters"):  # the second answer comes from the cache
        with pytest.raises(UnsupportedFieldError, match="invalid JSON schema at type") as raised:
            check_schema(param, {"type": "integr"})
        assert raised.value.param == param and str(raised.value).startswith(f"{param}: ")
    check_schema("response_format", {"type": "object", "properties": {"a": {"type": "integer"}}})
    hits = _schema_problem.cache_info().hits
    check_schema("response_format", {"properties": {"a": {"type": "integer"}}, "type": "object"})  # keys reordered
    assert _schema_problem.cache_info().hits == hits + 1
    deep: dict = {}
    for _ in range(5000):
        deep = {"items": deep}
    with pytest.raises(UnsupportedFieldError, match="nested too deeply"):
        check_schema("response_format", deep)


def test_auto_tool_choice_without_a_server_parser_is_a_400_naming_the_option(server, http, monkeypatch):
    monkeypatch.setattr(server.app.state.server, "tool_call_parser", None)
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        error = assert_openai_error(chat(http, **fields), 400, "tool_choice")
        assert "tool_call_parser" in error["message"] and "--tool-call-parser" in error["message"]
    assert chat(http, **with_tools(TOOLS, "none"), max_tokens=2).status_code == 200


# ---- what reaches the chat template ------------------------------------------------------------------------
HISTORY = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.mark.parametrize("fields", [
    {"tools": TOOLS, "tool_choice": "none"},
    {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"},
    {"messages": HISTORY, "chat_template_kwargs": {"enable_thinking": False, "unused_variable": 1}},
])
def test_tools_history_and_template_kwargs_reach_the_chat_template(server, http, fields):
    response = chat(http, max_tokens=1, **fields)
    assert response.status_code == 200, response.text
    messages = fields.get("messages", MESSAGES)
    rendered = server.tokenizer.apply_chat_template(
        [{**m, "content": m["content"] or ""} for m in messages], tools=fields.get("tools"),
        **fields.get("chat_template_kwargs", {}))
    assert response.json()["usage"]["prompt_tokens"] == len(server.tokenizer.encode(rendered, False))
    if "tools" in fields:
        assert '"name": "get_weather"' in rendered and "<tool_call>" in rendered
    if messages is HISTORY:
        assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in rendered
        assert "<|im_start|>tool\nsunny<|im_end|>" in rendered
    if "chat_template_kwargs" in fields:
        assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---- reasoning ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reasoning_server():
    config = EngineConfig(model="random:tiny", num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
                          reasoning_parser="deepseek_r1")
    with serving(config) as s:
        yield s


def test_the_engines_reasoning_parser_splits_the_response(http, reasoning_server):
    """DeepSeek-R1's template opens <think>: text without </think> is all reasoning. The same
    weights and greedy sampling give the plain server's text, here as reasoning."""
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    text = http.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    assert "</think>" not in text
    with httpx.Client(base_url=reasoning_server.url, timeout=60) as other:
        message = other.post(CHAT, json=body).json()["choices"][0]["message"]
        assert message["reasoning_content"] == message["reasoning"] == text and message["content"] is None
        events = sse_events(other.post(CHAT, json={**body, "stream": True}).text)
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == text
        assert "".join(d.get("reasoning", "") for d in deltas) == text
        assert not "".join(d.get("content") or "" for d in deltas)
        hidden = other.post(CHAT, json={**body, "include_reasoning": False}).json()["choices"][0]["message"]
        assert "reasoning_content" not in hidden and "reasoning" not in hidden and hidden["content"] is None


def test_the_history_reaches_the_template_in_the_shape_hf_templates_take():
    body = ChatCompletionRequest.model_validate({"messages": [
        *HISTORY, {"role": "assistant", "content": "x", "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}}],
         "reasoning_content": "thought", "refusal": None}], "tools": TOOLS, "tool_choice": "none"})
    messages = body.template_messages()
    assert messages[2] == {"role": "assistant", "content": "", "tool_calls": [  # arguments as an object
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "days": 1}}}]}
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert messages[4]["tool_calls"][0]["function"]["arguments"] == "not json"  # kept as sent
    assert messages[4]["reasoning_content"] == "thought" and "refusal" not in messages[4]
    assert body.template_tools() == TOOLS
