"""Chat responses of parsed outputs (chat_output.py through ResponseBuilder), on canned
engine deltas: reasoning split off, tool calls found, whole and streamed with the text split
at every position. Every body must parse with the official openai client's types and keep
to the app's OpenAPI schema; streamed pieces must add up to the whole response."""

import json

import jsonschema
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from roseray.engine.outputs import RequestDelta, RequestSummary
from roseray.openai_api import openapi
from roseray.openai_api.chat_output import ChatOutput
from roseray.openai_api.responses import ResponseBuilder, TokenText
from roseray.openai_api.tools import ToolPlan

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "ping"}}]
CHUNK_SCHEMA = jsonschema.Draft202012Validator(openapi.inline_schema(openapi.ChatCompletionChunk))
RESPONSE_SCHEMA = jsonschema.Draft202012Validator(openapi.inline_schema(openapi.ChatCompletionResponse))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
ARGUMENTS = json.dumps({"city": "Paris", "days": 2})


def delta(text: str, finished: bool = False, reason: str = "stop") -> RequestDelta:
    return RequestDelta("r", [5], text, finished, reason if finished else None, None, 3, 4, RequestSummary(0.0))


def builder(output: ChatOutput | None) -> ResponseBuilder:
    return ResponseBuilder("chat", "chatcmpl-1", "m", TokenText(lambda ids: "t"), chat_output=output)


def whole(output: ChatOutput, text: str, reason: str = "stop") -> dict:
    body = builder(output).full_response(text, [5], None, delta("", True, reason))
    RESPONSE_SCHEMA.validate(body)
    ChatCompletion.model_validate(body)
    return body["choices"][0]


def streamed(output: ChatOutput, pieces: list[str], reason: str = "stop") -> tuple[dict, str]:
    """The stream's deltas added up (text fields joined, tool calls gathered by index, checking
    that id, type and name come once, on a call's first delta) and its finish_reason."""
    b = builder(output)
    raw = b"".join([*(b.delta_event(delta(p)) for p in pieces), b.stream_chunks([delta("", True, reason)])])
    events = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n\n") if line]
    total: dict = {"tool_calls": {}}
    for event in events:
        CHUNK_SCHEMA.validate(event)
        ChatCompletionChunk.model_validate(event)
        d = event["choices"][0]["delta"]
        for key in ("content", "reasoning_content", "reasoning"):
            if d.get(key):  # the first chunk's content is "" (with the role)
                total[key] = total.get(key, "") + d[key]
        indexes = [call["index"] for call in d.get("tool_calls", ())]
        assert len(indexes) == len(set(indexes)), d  # one entry per call in a chunk
        for call in d.get("tool_calls", ()):
            seen = total["tool_calls"].get(call["index"])
            if seen is None:
                assert call["id"] and call["type"] == "function" and call["function"]["name"], call
                total["tool_calls"][call["index"]] = {"id": call["id"], "name": call["function"]["name"],
                                                      "arguments": call["function"].get("arguments", "")}
            else:
                assert "id" not in call and "name" not in call["function"], call
                seen["arguments"] += call["function"].get("arguments", "")
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    return total, events[-1]["choices"][0]["finish_reason"]


def splits(text: str):
    """The text in two pieces at every position, and one character at a time."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)


# ---- tool calls ------------------------------------------------------------------------------------------
def test_auto_finds_the_calls_and_keeps_the_rest_as_content():
    output = ChatOutput(ToolPlan("auto"), "hermes", tools=TOOLS)
    text = "Let me check." + CALL
    choice = whole(output, text)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS} and call["type"] == "function"
    for pieces in splits(text):
        total, finish = streamed(output, pieces)
        assert finish == "tool_calls" and total["content"] == "Let me check."
        assert [(c["name"], c["arguments"]) for c in total["tool_calls"].values()] == [("get_weather", ARGUMENTS)]


def test_auto_without_calls_is_plain_content_and_keeps_the_engines_finish_reason():
    output = ChatOutput(ToolPlan("auto"), "hermes", tools=TOOLS)
    choice = whole(output, "no calls here", "length")
    assert choice["message"]["content"] == "no calls here" and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"
    assert streamed(output, ["no calls", " here"], "length") == ({"tool_calls": {}, "content": "no calls here"},
                                                                  "length")


def test_a_call_cut_by_max_tokens_does_not_say_tool_calls():
    output = ChatOutput(ToolPlan("auto"), "hermes", tools=TOOLS)
    choice = whole(output, CALL[:30], "length")
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]


@pytest.mark.parametrize("reason,expected", [("stop", "tool_calls"), ("length", "length")])
def test_required_calls_are_the_json_list(reason, expected):
    output = ChatOutput(ToolPlan("required"), tools=TOOLS)
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}},
                       {"name": "ping", "parameters": {}}])
    choice = whole(output, text, reason)
    assert choice["finish_reason"] == expected and choice["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris", "days": 2}), ("ping", {})]
    ids = [c["id"] for c in choice["message"]["tool_calls"]]
    assert len(set(ids)) == 2
    for pieces in (list(text), [text[:17], text[17:]]):
        total, finish = streamed(output, pieces, reason)
        assert finish == expected and "content" not in total
        assert [json.loads(c["arguments"]) for c in total["tool_calls"].values()] == [{"city": "Paris", "days": 2}, {}]


def test_a_named_call_is_the_whole_output():
    output = ChatOutput(ToolPlan("named", "get_weather"), tools=TOOLS)
    text = '{"city": "Paris", "days": 2}'
    choice = whole(output, text)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    for pieces in splits(text):
        total, finish = streamed(output, pieces)
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in total["tool_calls"].values()] == [("get_weather", ARGUMENTS)]


# ---- reasoning ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parser,text", [("qwen3", "<think>\nhmm, rain?\n</think>\n\nIt rains."),
                                         ("deepseek_r1", "hmm, rain?\n</think>\n\nIt rains.")])
def test_reasoning_is_split_off_whole_and_streamed(parser, text):
    output = ChatOutput(ToolPlan(), reasoning_parser=parser)
    message = whole(output, text)["message"]
    assert message["reasoning_content"] == message["reasoning"] and "rain?" in message["reasoning_content"]
    assert "</think>" not in message["reasoning_content"] and "think>" not in (message["content"] or "")
    assert message["content"].strip() == "It rains."
    for pieces in splits(text):
        total, finish = streamed(output, pieces)
        assert finish == "stop"
        assert total.get("reasoning_content") == total.get("reasoning") == message["reasoning_content"]
        assert total.get("content") == message["content"]


def test_include_reasoning_false_leaves_the_reasoning_out():
    output = ChatOutput(ToolPlan(), reasoning_parser="qwen3", include_reasoning=False)
    text = "<think>secret</think>answer"
    message = whole(output, text)["message"]
    assert message == {"role": "assistant", "content": "answer"}
    total, _ = streamed(output, list(text))
    assert total == {"tool_calls": {}, "content": "answer"}


def test_tool_calls_are_parsed_after_the_reasoning():
    output = ChatOutput(ToolPlan("auto"), "hermes", reasoning_parser="qwen3", tools=TOOLS)
    text = f"<think>a <tool_call> in thought</think>{CALL}"
    choice = whole(output, text)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert "<tool_call>" in choice["message"]["reasoning_content"]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    for pieces in splits(text):
        total, finish = streamed(output, pieces)
        assert finish == "tool_calls" and total["reasoning_content"] == choice["message"]["reasoning_content"]
        assert [(c["name"], c["arguments"]) for c in total["tool_calls"].values()] == [("get_weather", ARGUMENTS)]


def test_a_plain_chat_request_keeps_the_template_fast_path():
    assert builder(None)._text_event is not None and builder(None)._parsed is None
    assert builder(ChatOutput(ToolPlan(), reasoning_parser="qwen3"))._text_event is None


@pytest.mark.parametrize("prompt,first", [
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", {"content": "It"}),  # thinking off: content at once
    ("<|im_start|>assistant\n<think>\n", {"reasoning_content": "It", "reasoning": "It"}),  # the template opened it
])
def test_the_prompt_says_where_the_output_starts(prompt, first):
    output = ChatOutput(ToolPlan(), reasoning_parser="qwen3", prompt=prompt)
    stream = output.stream()
    assert stream.feed("It") == first
    assert whole(output, "It rains.")["message"][next(iter(first))] == "It rains."
