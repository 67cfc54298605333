"""Reasoning parsers on canned model output: split() of whole texts, and streaming the same text
split anywhere (every two-chunk split, single characters, random splits) gives the same
reasoning and content."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseray.config import REASONING_PARSERS as REASONING_PARSER_NAMES
from roseray.openai_api.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    make_reasoning_parser,
)

THOUGHT = "<think>\nThe user wants 2 < 3 </thin and </ think>.\n\nSo: yes.\n</think>\n\nYes, 2 < 3.\n"

# (parser, starts_in_reasoning, text, reasoning, content)
CASES = [
    ("qwen3", None, THOUGHT, "The user wants 2 < 3 </thin and </ think>.\n\nSo: yes.", "Yes, 2 < 3.\n"),
    ("qwen3", None, "\n<think>\n\n</think>\n\nHi", None, "Hi"),  # an empty think block
    ("qwen3", None, "\nPlain answer, thinking off.\n", None, "\nPlain answer, thinking off.\n"),
    ("qwen3", None, "The template opened it.\n</think>\n\nAnswer", "The template opened it.", "Answer"),
    ("qwen3", None, "<think>Cut off while thinking", "Cut off while thinking", None),
    ("qwen3", None, "<thinking> is not the tag", None, "<thinking> is not the tag"),
    ("qwen3", None, "<think>a</think>b</think>c <think>d", "a", "b</think>c <think>d"),
    ("qwen3", None, "unicode 思考</think>答案 🎉", "unicode 思考", "答案 🎉"),
    ("qwen3", None, "", None, None),
    ("qwen3", None, "<thi", None, "<thi"),
    ("qwen3", False, "Plain answer</think> stays", None, "Plain answer</think> stays"),
    ("qwen3", False, "<think>\nr\n</think>\n\nc", "r", "c"),
    ("qwen3", True, "r</think>c", "r", "c"),
    ("deepseek_r1", None, THOUGHT, "The user wants 2 < 3 </thin and </ think>.\n\nSo: yes.", "Yes, 2 < 3.\n"),
    ("deepseek_r1", None, "\nOpened by the template\n</think>\n\nAnswer", "Opened by the template", "Answer"),
    ("deepseek_r1", None, "Never ends </thin", "Never ends </thin", None),
    ("deepseek_r1", None, "</think>Only content", None, "Only content"),
    ("deepseek_r1", None, "<th", "<th", None),
    ("deepseek_r1", False, "No reasoning at all", None, "No reasoning at all"),
]


def stream_text(parser: ReasoningParser, starts_in_reasoning, chunks: list[str]) -> tuple[str, str, bool]:
    stream = parser.stream(starts_in_reasoning)
    reasoning, content = [], []
    for chunk in chunks:
        piece_reasoning, piece_content = stream.feed(chunk)
        reasoning.append(piece_reasoning)
        content.append(piece_content)
    ended_before_finish = stream.reasoning_ended
    piece_reasoning, piece_content = stream.finish()
    assert stream.reasoning_ended
    return "".join(reasoning + [piece_reasoning]), "".join(content + [piece_content]), ended_before_finish


def every_split(text: str):
    yield [text]
    yield list(text)
    for position in range(1, len(text)):
        yield [text[:position], text[position:]]


@pytest.mark.parametrize("name, starts_in_reasoning, text, reasoning, content", CASES)
def test_split(name, starts_in_reasoning, text, reasoning, content):
    assert make_reasoning_parser(name).split(text, starts_in_reasoning) == (reasoning, content)


@pytest.mark.parametrize("name, starts_in_reasoning, text, reasoning, content", CASES)
def test_stream_every_split(name, starts_in_reasoning, text, reasoning, content):
    parser = make_reasoning_parser(name)
    for chunks in every_split(text):
        assert stream_text(parser, starts_in_reasoning, chunks)[:2] == (reasoning or "", content or "")


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_stream_random_splits(case, cuts):
    name, starts_in_reasoning, text, reasoning, content = case
    points = sorted({cut % (len(text) + 1) for cut in cuts})
    chunks = [text[start:end] for start, end in zip([0, *points], [*points, len(text)])]
    assert stream_text(make_reasoning_parser(name), starts_in_reasoning, chunks)[:2] == (reasoning or "",
                                                                                          content or "")


@settings(max_examples=200, deadline=None)
@given(reasoning=st.text(), content=st.text(), name=st.sampled_from(REASONING_PARSER_NAMES))
def test_any_reasoning_and_content_come_back(reasoning, content, name):
    """Whatever the texts (the reasoning without the end tag), <think>r</think>c splits back
    into r and c, less the newlines dropped at their edges."""
    while "</think>" in reasoning:
        reasoning = reasoning.replace("</think>", "")
    got = make_reasoning_parser(name).split(f"<think>{reasoning}</think>{content}")
    assert got == (reasoning.strip("\r\n") or None, content.lstrip("\r\n") or None)


def test_stream_sends_each_side_as_soon_as_it_is_known():
    stream = make_reasoning_parser("qwen3").stream()
    assert stream.feed("<think>\nStep one") == ("Step one", "")
    assert stream.feed("\n</thi") == ("", "")  # the newline and a possible tag are held
    assert not stream.reasoning_ended
    assert stream.feed("nk>\n\nThe") == ("", "The")
    assert stream.reasoning_ended
    assert stream.feed(" answer</think>") == ("", " answer</think>")
    assert stream.finish() == ("", "")


def test_qwen3_without_an_opening_tag_waits_unless_told_how_the_prompt_ends():
    undecided = make_reasoning_parser("qwen3").stream()
    assert undecided.feed("Hello there") == ("", "")  # reasoning if </think> comes, else content
    assert undecided.finish() == ("", "Hello there")
    told = make_reasoning_parser("qwen3").stream(starts_in_reasoning=False)
    assert told.feed("Hello there") == ("", "Hello there")
    assert told.reasoning_ended
    opened = make_reasoning_parser("qwen3").stream(starts_in_reasoning=True)
    assert opened.feed("Hmm") == ("Hmm", "")


def test_prompt_opens_reasoning():
    opens = ReasoningParser.prompt_opens_reasoning
    assert opens("<|im_start|>assistant\n<think>\n")
    assert not opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3 with enable_thinking=false
    assert not opens("<|im_start|>assistant\n")
    assert not opens("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n")


def test_registry_matches_config_and_exports_the_end_tag():
    assert tuple(REASONING_PARSERS) == REASONING_PARSER_NAMES
    assert REASONING_PARSERS["qwen3"] is Qwen3ReasoningParser
    assert REASONING_PARSERS["deepseek_r1"] is DeepSeekR1ReasoningParser
    for name in REASONING_PARSER_NAMES:
        assert make_reasoning_parser(name).end_tag == "</think>"
    assert Qwen3ReasoningParser.end_tag == "</think>"
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        make_reasoning_parser("nope")
