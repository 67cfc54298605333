"""Tool-call parsers on canned model output: what extract() finds, and that streaming the same
text split anywhere (every two-chunk split, single characters, random splits) gives the same
content, calls and arguments."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseray.config import TOOL_CALL_PARSERS
from roseray.openai_api.json_stream import JsonError, JsonRewriter
from roseray.openai_api.tool_parsers import (
    TOOL_PARSERS,
    NamedToolCallStream,
    RequiredToolCallsStream,
    ToolCall,
    ToolCallStream,
    make_tool_parser,
    new_tool_call_id,
    parse_required_tool_calls,
)

# arguments with everything that could end a call early or break a naive scanner
NESTED = {"path": "a}b]c<d", "quote": 'say "hi" \\ </tool_call> [TOOL_CALLS] ;', "list": [1, -2.5, 1e20, True, None],
          "deep": {"x": [{"y": "}]"}, []], "empty": {}}, "unicode": "café 中文 🎉", "newline": "a\nb\tc"}
NESTED_JSON = json.dumps(NESTED, ensure_ascii=False)


def dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


# (text, content, [(name, arguments object)]) per format: well-formed output
HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ('Let me check both.\n<tool_call>\n{"name": "a", "arguments": {"n": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     "Let me check both.\n\n", [("a", {"n": 1}), ("b", {})]),
    (f'<tool_call>{{"name": "nested", "arguments": {NESTED_JSON}}}</tool_call> after',
     " after", [("nested", NESTED)]),
    # \u escapes (a surrogate pair too), escaped solidus, exponent: rewritten to json.dumps form
    ('<tool_call>{"arguments": {"s": "caf\\u00e9 \\ud83c\\udf89 \\/", "e": 1E2, "z": -0}, "name": "f",'
     ' "id": 7}</tool_call>',
     None, [("f", {"s": "café 🎉 /", "e": 100.0, "z": 0})]),
    ('<tool_call>{"name": "no_args"}</tool_call><tool_call>{"name": "unknown_tool", "arguments": {"k": "v"}}',
     None, [("no_args", {}), ("unknown_tool", {"k": "v"})]),  # the last closing tag was cut off
    ('a < b, and <tool it is not> <tool_call', "a < b, and <tool it is not> <tool_call", []),
    ('   \n', None, []),
    ('\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone', "\nDone", [("f", {})]),  # blank before a call
]
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "arguments": {"q": [1, 2]}}',
     None, [("a", {"n": 1}), ("b", {"q": [1, 2]})]),
    (f'\n {{"name": "nested", "parameters": {NESTED_JSON}}}', None, [("nested", NESTED)]),
    ('{"name": "a", "parameters": {}}\n\nThat was the call.', "\n\nThat was the call.", [("a", {})]),
    ('The answer is {"name": "a", "parameters": {}}', 'The answer is {"name": "a", "parameters": {}}', []),
    ('<|python_start|> no', "<|python_start|> no", []),
    (' \n{"name": "a", "parameters": {}}\nok', "\nok", [("a", {})]),
]
MISTRAL = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    ('Sure.[TOOL_CALLS] [ {"name": "a", "arguments": {"n": 1}, "id": "abc123def"} , {"name": "b", "arguments": {}}]',
     "Sure.", [("a", {"n": 1}), ("b", {})]),
    (f'[TOOL_CALLS][{{"name": "nested", "arguments": {NESTED_JSON}}}] done', " done", [("nested", NESTED)]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]other.tool-2[ARGS]{"a": [1]}', None,
     [("get_weather", {"city": "Paris"}), ("other.tool-2", {"a": [1]})]),
    ('[TOOL_CALLS][]', None, []),
    ('[TOOL_CALL] and [ARGS] are text [TOOL', "[TOOL_CALL] and [ARGS] are text [TOOL", []),
]
WELL_FORMED = ([("hermes", *case) for case in HERMES] + [("llama3_json", *case) for case in LLAMA3]
               + [("mistral", *case) for case in MISTRAL])

# malformed calls: (parser, text, content, [(name, arguments)]): the malformed call's text is content
MALFORMED = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>', []),
    ("hermes", 'x <tool_call>not json</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>',
     "x <tool_call>not json</tool_call>", [("g", {})]),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "cut', '<tool_call>{"name": "f", "arguments": {"a": "cut',
     []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}} junk</tool_call>',
     '<tool_call>{"name": "f", "arguments": {}} junk</tool_call>', []),
    ("hermes", '<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": 3}</tool_call>', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "a", "parameters": {}}; oops', "; oops", [("a", {})]),
    ("llama3_json", '<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {nope}}]',
     ', {"name": "b", "arguments": {nope}}]', [("a", {})]),
    ("mistral", 'Hi [TOOL_CALLS]bad name[ARGS]{}', "Hi [TOOL_CALLS]bad name[ARGS]{}", []),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ', '[TOOL_CALLS]f[ARGS]{"a": ', []),
]


def collect(stream: ToolCallStream, chunks: list[str]):
    """Feeds the chunks; checks the deltas' shape; returns (content, {index: (id, name, arguments)})."""
    content, calls = [], {}
    deltas = []
    for chunk in chunks:
        delta = stream.feed(chunk)
        content.append(delta.content)
        deltas += delta.tool_calls
    delta = stream.finish()
    content.append(delta.content)
    deltas += delta.tool_calls
    for delta in deltas:
        if delta.index not in calls:
            assert delta.index == len(calls), "indexes start at 0 and count up in order"
            assert delta.id is not None and delta.name and delta.arguments == "", "a call's first delta"
            calls[delta.index] = [delta.id, delta.name, ""]
        else:
            assert delta.id is None and delta.name is None and delta.arguments, "later deltas: arguments only"
            assert delta.index == max(calls), "a call's pieces come before the next call's"
            calls[delta.index][2] += delta.arguments
    return "".join(content), {index: tuple(call) for index, call in calls.items()}


def check_stream(parser, text: str, chunks: list[str], well_formed: bool) -> None:
    assert "".join(chunks) == text
    expected = parser.extract(text)
    stream = parser.stream()
    content, deltas = collect(stream, chunks)
    assert content == (expected.content or "")
    calls = stream.tool_calls
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected.tool_calls]
    streamed = {call_id: (name, arguments) for call_id, name, arguments in deltas.values()}
    for call in calls:  # every completed call was streamed whole, under its id
        assert streamed[call.id] == (call.name, call.arguments)
    if well_formed:
        assert len(deltas) == len(calls)


def every_split(text: str):
    yield [text]
    yield list(text)
    for position in range(1, len(text)):
        yield [text[:position], text[position:]]


@pytest.mark.parametrize("parser_name, text, content, calls", WELL_FORMED + MALFORMED)
def test_extract(parser_name, text, content, calls):
    result = make_tool_parser(parser_name, []).extract(text)
    assert result.content == content
    assert [(call.name, call.arguments) for call in result.tool_calls] == [(name, dumps(args)) for name, args in calls]
    for call in result.tool_calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
    assert len({call.id for call in result.tool_calls}) == len(result.tool_calls)


@pytest.mark.parametrize("parser_name, text, content, calls", WELL_FORMED)
def test_stream_every_split_well_formed(parser_name, text, content, calls):
    parser = make_tool_parser(parser_name, None)
    for chunks in every_split(text):
        check_stream(parser, text, chunks, well_formed=True)


@pytest.mark.parametrize("parser_name, text, content, calls", MALFORMED)
def test_stream_every_split_malformed(parser_name, text, content, calls):
    parser = make_tool_parser(parser_name, None)
    for chunks in every_split(text):
        check_stream(parser, text, chunks, well_formed=False)


def random_chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({cut % (len(text) + 1) for cut in cuts})
    return [text[start:end] for start, end in zip([0, *points], [*points, len(text)])]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(WELL_FORMED + MALFORMED), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_stream_random_splits(case, cuts):
    parser_name, text, _, _ = case
    check_stream(make_tool_parser(parser_name, None), text, random_chunks(text, cuts), well_formed=case in WELL_FORMED)


def test_stream_sends_content_and_calls_as_they_become_certain():
    stream = make_tool_parser("hermes", None).stream()
    assert stream.feed("Hello <tool").content == "Hello "  # "<tool" may open a call: held back
    delta = stream.feed('_call>{"arguments": {"a": "x')
    assert delta.content == "" and delta.tool_calls == []  # no name yet: the arguments wait for it
    delta = stream.feed('y"}, "name": "f"')
    assert [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [(0, "f", ""), (0, None, '{"a": "xy"}')]
    assert stream.tool_calls == []  # the call is not complete until its closing tag
    delta = stream.feed('}</tool_call><tool_call>{"name": "g", "arguments": {"b": [1')
    assert [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [(1, "g", ""), (1, None, '{"b": [')]
    assert [call.name for call in stream.tool_calls] == ["f"]
    assert stream.feed(", 2]}}</tool_call> <b>").content == " <b>"
    assert stream.finish().content == ""
    assert [(call.name, call.arguments) for call in stream.tool_calls] == [("f", '{"a": "xy"}'), ("g", '{"b": [1, 2]}')]


def test_a_call_that_fails_after_its_header_is_content_and_the_next_call_takes_the_next_index():
    stream = make_tool_parser("hermes", None).stream()
    first = stream.feed('<tool_call>{"name": "f", "arguments": {"a": 1')
    assert [(d.index, d.name) for d in first.tool_calls] == [(0, "f"), (0, None)]
    failed = stream.feed('}} x</tool_call>')
    assert failed.content == '<tool_call>{"name": "f", "arguments": {"a": 1}} x</tool_call>'
    last = stream.feed('<tool_call>{"name": "g"}</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in last.tool_calls] == [(1, "g", ""), (1, None, "{}")]
    stream.finish()
    assert [call.name for call in stream.tool_calls] == ["g"]


def test_llama3_output_that_does_not_start_with_a_call_streams_as_content_at_once():
    stream = make_tool_parser("llama3_json", None).stream()
    assert stream.feed("Sure").content == "Sure"
    assert stream.feed(' {"name": "a", "parameters": {}}').content == ' {"name": "a", "parameters": {}}'
    assert stream.finish().content == "" and stream.tool_calls == []


def test_registry_matches_config_and_unknown_names_are_refused():
    assert tuple(TOOL_PARSERS) == TOOL_CALL_PARSERS
    for name in TOOL_CALL_PARSERS:
        assert make_tool_parser(name, []).name == name
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        make_tool_parser("nope", [])


def test_tools_are_kept_and_a_name_not_among_them_is_still_a_call():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    parser = make_tool_parser("hermes", tools)
    assert parser.tool_names == {"get_weather"}
    result = parser.extract('<tool_call>{"name": "other", "arguments": {}}</tool_call>')
    assert [call.name for call in result.tool_calls] == ["other"]


def test_ids_have_openais_shape_and_differ():
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert ToolCall("f", "{}").id != ToolCall("f", "{}").id


# -- tool_choice "required" and named --

REQUIRED = ('[{"name": "a", "parameters": {"x": [1, {"y": "]}"}]}},\n {"name": "b", "parameters": {}}, '
            f'{{"parameters": {NESTED_JSON}, "name": "c"}}]')


def test_required_calls():
    calls = parse_required_tool_calls(REQUIRED)
    assert [(c.name, c.arguments) for c in calls] == [("a", dumps({"x": [1, {"y": "]}"}]})), ("b", "{}"),
                                                       ("c", NESTED_JSON)]
    assert [(c.name, c.arguments) for c in parse_required_tool_calls(' [ {"name":"a","parameters":{}} ] ')] == \
        [("a", "{}")]
    assert parse_required_tool_calls("[]") == []
    cut = parse_required_tool_calls('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1')
    assert [c.name for c in cut] == ["a"]  # cut off by max_tokens: the complete calls stand


@pytest.mark.parametrize("text, content, names", [
    ('[{"name": "a", "parameters": {}},]', ",]", ["a"]),
    ('[{"name": "a", "parameters": {}}] after', " after", ["a"]),
    ("no array", "no array", []),
    ('[{"name": "a", "parameters": []}]', '[{"name": "a", "parameters": []}]', []),
])
def test_required_stream_text_that_is_not_the_array_is_content(text, content, names):
    for chunks in every_split(text):
        stream = RequiredToolCallsStream()
        assert collect(stream, chunks)[0] == content
        assert [call.name for call in stream.tool_calls] == names


def test_required_stream_every_split():
    expected = [(c.name, c.arguments) for c in parse_required_tool_calls(REQUIRED)]
    for chunks in every_split(REQUIRED):
        stream = RequiredToolCallsStream()
        content, deltas = collect(stream, chunks)
        assert content == ""
        assert [(name, arguments) for _, name, arguments in deltas.values()] == expected
        assert [(c.name, c.arguments) for c in stream.tool_calls] == expected


NAMED = f' {{"q" : "weather \\u00e9",\n  "nested": {NESTED_JSON}, "n": 1.50}}'


def test_named_stream_every_split():
    expected = dumps(json.loads(NAMED))
    for chunks in every_split(NAMED):
        stream = NamedToolCallStream("get_weather")
        content, deltas = collect(stream, chunks)
        assert content == "" and list(deltas) == [0]
        call_id, name, arguments = deltas[0]
        assert (name, arguments) == ("get_weather", expected)
        assert [(c.id, c.name, c.arguments) for c in stream.tool_calls] == [(call_id, name, expected)]


def test_named_stream_first_delta_is_the_header_and_the_call_waits_for_the_object():
    stream = NamedToolCallStream("f")
    first = stream.feed("")
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [(0, "f", "")] and first.tool_calls[0].id
    assert [d.arguments for d in stream.feed('{"a": tr').tool_calls] == ['{"a": ']
    assert stream.tool_calls == []
    assert [d.arguments for d in stream.feed('ue}').tool_calls] == ["true}"]
    assert [c.arguments for c in stream.tool_calls] == ['{"a": true}']
    assert stream.finish().tool_calls == []


def test_named_stream_passes_on_text_that_is_not_json():
    stream = NamedToolCallStream("f")
    pieces = [d.arguments for d in stream.feed('{"a": 1} trailing').tool_calls]
    assert pieces == ["", '{"a": 1}trailing']
    stream.finish()
    assert [c.arguments for c in stream.tool_calls] == ['{"a": 1}trailing']


# -- the JSON rewriter under the parsers --

class _Collect:
    def __init__(self):
        self.pieces, self.members = [], []

    def text(self, member, piece):
        self.pieces.append(piece)

    def member_end(self, member):
        self.members.append(member)


def rewrite(text: str) -> str:
    sink = _Collect()
    rewriter = JsonRewriter(sink)
    for char in text:
        if not rewriter.push(char) and not char.isspace():
            raise JsonError("text after the value")
    rewriter.end()
    return "".join(sink.pieces)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(value=json_values, indent=st.sampled_from([None, 0, 2]), ensure_ascii=st.booleans())
def test_rewriter_gives_json_dumps_form(value, indent, ensure_ascii):
    text = json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)
    assert rewrite(text) == json.dumps(value, ensure_ascii=False)


def test_rewriter_edge_cases():
    assert rewrite('"raw\nnewline\u0001"') == dumps("raw\nnewline\u0001")  # control characters accepted
    assert rewrite("1e400") == "1e400"  # json.dumps would write Infinity
    assert rewrite('"\\ud800x"') == '"\\ud800x"'  # a lone surrogate stays an escape
    assert rewrite("-0.0") == "-0.0" and rewrite(" 12 ") == "12"
    sink = _Collect()
    rewriter = JsonRewriter(sink)
    for char in '{"a": 1, "b\\u0041": {"c": 2}, "d": [3]}':
        rewriter.push(char)
    assert rewriter.done and sink.members == ["a", "bA", "d"]


@pytest.mark.parametrize("text", ["{", '{"a" 1}', "[1,]", "{,}", "NaN", "01", "tru", '"\\x"', "[1}", '{"a": 1} x'])
def test_rewriter_refuses_what_is_not_json(text):
    with pytest.raises(JsonError):
        rewrite(text)


def test_rewriter_object_only_refuses_other_values():
    with pytest.raises(JsonError, match="expected a JSON object"):
        JsonRewriter(_Collect(), object_only=True).push("[")
