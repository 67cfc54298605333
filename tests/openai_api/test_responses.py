"""SSE chunk bodies: the template fast path gives exactly the bytes of the general path."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from roseray.engine.outputs import RequestDelta
from roseray.openai_api.responses import ResponseBuilder, TokenText


def builder(kind: str, include_usage: bool) -> ResponseBuilder:
    return ResponseBuilder(kind, f"{kind}-0123", 'model "quoted" é', TokenText(lambda ids: "t"),
                           include_usage=include_usage)


def delta(text: str, finished: bool = False) -> RequestDelta:
    return RequestDelta("r", [5], text, finished, "length" if finished else None, None, 3, 4, None)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["completion", "chat"]), st.booleans(), st.text(min_size=1, max_size=12))
def test_fast_text_events_equal_the_general_path(kind, include_usage, text):
    fast, general = builder(kind, include_usage), builder(kind, include_usage)
    general._text_event = None  # force the dict + json.dumps path
    fast.sent_role = general.sent_role = True
    general.created = fast.created
    chunks = [delta(text), delta(text + "x")]
    assert fast.stream_chunks(chunks) == general.stream_chunks(chunks)
    event = json.loads(fast.stream_chunks([delta(text)])[len(b"data: "):])
    got = event["choices"][0]["delta"]["content"] if kind == "chat" else event["choices"][0]["text"]
    assert got == text and ("usage" in event) == include_usage


def test_the_last_event_and_logprobs_requests_take_the_general_path():
    b = builder("completion", True)
    last = json.loads(b.stream_chunks([delta("end", finished=True)])[len(b"data: "):])
    assert last["choices"][0]["finish_reason"] == "length"
    with_logprobs = ResponseBuilder("completion", "c", "m", TokenText(lambda ids: "t"), num_top_logprobs=1)
    assert with_logprobs._text_event is None
    continuous = ResponseBuilder("chat", "c", "m", TokenText(lambda ids: "t"), include_usage=True,
                                 continuous_usage=True)
    assert continuous._text_event is None


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["completion", "chat"]), st.booleans(), st.lists(st.text(max_size=6), min_size=1, max_size=4))
def test_delta_event_gives_the_bytes_of_stream_chunks(kind, include_usage, texts):
    fast, general = builder(kind, include_usage), builder(kind, include_usage)
    general.created = fast.created
    for text in texts:  # a chat stream's first event carries the role either way
        assert fast.delta_event(delta(text)) == general.stream_chunks([delta(text)])
