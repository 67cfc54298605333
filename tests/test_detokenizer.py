"""Incremental detokenization (multi-byte characters, equality with a full decode) and stop strings."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseray.engine.detokenizer import ByteDetokenizer, IncrementalDetokenizer, find_stop_string, make_detokenizer
from roseray.tokenizer import ByteTokenizer as PresetByteTokenizer

SPECIAL_ID = 256  # the toy tokenizer's one special token


class ByteTokenizer:
    """ids 0..255 are bytes; 256 is a special token; decoding replaces invalid UTF-8 with U+FFFD."""

    def __init__(self) -> None:
        self.decoded_lengths: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(token_ids))
        parts, chunk = [], bytearray()
        for token_id in token_ids:
            if token_id < 256:
                chunk.append(token_id)
                continue
            parts.append(chunk.decode("utf-8", errors="replace"))
            chunk = bytearray()
            if not skip_special_tokens:
                parts.append("<|special|>")
        parts.append(chunk.decode("utf-8", errors="replace"))
        return "".join(parts)


def split_randomly(ids: list[int], rng: random.Random, max_chunk: int = 4) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, max_chunk)
        chunks.append(ids[start:start + size])
        start += size
    return chunks


TEXT = "héllo 世界 🙂 ok"


def test_multibyte_characters_split_across_steps_come_out_once_and_complete():
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "))
    deltas = [detok.step([token_id]) for token_id in tokenizer.encode(TEXT)]
    assert "".join(deltas) == TEXT == detok.output_text
    assert all("\ufffd" not in delta for delta in deltas)
    released = [d for d in deltas if d]
    assert "世" in released and "🙂" in released  # each released whole, in one step
    # The 4 bytes of 🙂: three steps release nothing, the fourth releases the character.
    emoji_start = len("héllo 世界 ".encode())
    assert deltas[emoji_start:emoji_start + 4] == ["", "", "", "🙂"]


def test_random_chunking_gives_the_same_text():
    tokenizer = ByteTokenizer()
    rng = random.Random(0)
    for _ in range(20):
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("a 世"))
        deltas = [detok.step(chunk) for chunk in split_randomly(tokenizer.encode(TEXT), rng)]
        assert "".join(deltas) == TEXT and "\ufffd" not in "".join(deltas)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 256), max_size=60), st.lists(st.integers(0, 255), max_size=8),
       st.booleans(), st.randoms(use_true_random=False))
def test_incremental_equals_full_decode_for_any_ids(output_ids, prompt_text_ids, skip_special, rng):
    tokenizer = ByteTokenizer()
    prompt_ids = tokenizer.encode(bytes(prompt_text_ids).decode("utf-8", errors="ignore"))  # a whole-char prompt
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special)
    text = "".join(detok.step(chunk) for chunk in split_randomly(output_ids, rng)) + detok.flush()
    assert text == detok.output_text == tokenizer.decode(output_ids, skip_special_tokens=skip_special)


def test_special_tokens_follow_skip_special_tokens():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("ab") + [SPECIAL_ID] + tokenizer.encode("c")
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for token_id in ids:
        skipped.step([token_id])
        kept.step([token_id])
    assert skipped.output_text == "abc" and kept.output_text == "ab<|special|>c"


def test_cost_per_step_does_not_grow_with_length():
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x" * 1000))
    for token_id in tokenizer.encode("word " * 400 + "世界" * 100):
        detok.step([token_id])
    assert max(tokenizer.decoded_lengths) <= 8  # prompt context (5) + a held-back character


def test_flush_releases_an_incomplete_tail_as_replacement_char():
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.step(tokenizer.encode("ok") + tokenizer.encode("世")[:2]) == ""
    assert detok.flush() == "ok\ufffd"
    assert detok.flush() == ""


# --- stop strings ---------------------------------------------------------------------------


def run_with_stops(chunks: list[str], stops: list[str], include: bool) -> tuple[str, str | None, int]:
    """What the engine does: step, then look for a stop in the new text; cut and finish on a match."""
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, [])
    for step, chunk in enumerate(chunks):
        new_text = detok.step(tokenizer.encode(chunk))
        found = find_stop_string(detok.output_text, len(new_text), stops, include)
        if found is not None:
            cut, stop = found
            return detok.output_text[:cut], stop, step
    return detok.output_text, None, len(chunks)


def test_stop_string_cuts_exactly_before_the_stop():
    text, stop, step = run_with_stops(["Hello", " world", ". STOP", " more"], ["STOP"], include=False)
    assert (text, stop, step) == ("Hello world. ", "STOP", 2)


def test_stop_string_included_when_asked():
    text, stop, _ = run_with_stops(["Hello", " world", ". STOP", " more"], ["STOP"], include=True)
    assert (text, stop) == ("Hello world. STOP", "STOP")


@pytest.mark.parametrize("include, expected", [(False, "Hello "), (True, "Hello STOP")])
def test_stop_string_straddling_two_steps(include, expected):
    text, stop, step = run_with_stops(["Hello ST", "OP more", "x"], ["STOP"], include)
    assert (text, stop, step) == (expected, "STOP", 1)


def test_stop_string_straddling_byte_steps_with_multibyte_stop():
    tokenizer = ByteTokenizer()
    detok = IncrementalDetokenizer(tokenizer, [])
    found = None
    for token_id in tokenizer.encode("abc 世界 def"):
        new_text = detok.step([token_id])
        found = find_stop_string(detok.output_text, len(new_text), ["界 d"], include_in_output=False)
        if found:
            break
    assert found == (5, "界 d") and detok.output_text[:found[0]] == "abc 世"


def test_earliest_stop_wins_and_old_matches_are_not_found_again():
    assert find_stop_string("one two three", 9, ["three", "two"], False) == (4, "two")
    assert find_stop_string("ab", 2, ["ab", "a"], True) == (2, "ab")  # same start: listed first
    assert find_stop_string("ab", 2, ["a", "ab"], True) == (1, "a")
    assert find_stop_string("STOP then", 5, ["STOP"], False) is None  # ended before the new text
    assert find_stop_string("xSTOP", 1, ["STOP"], False) == (1, "STOP")  # only its last char is new
    assert find_stop_string("anything", 0, ["any"], False) is None
    assert find_stop_string("text", 4, [], False) is None


def test_invalid_utf8_forever_is_released_and_stays_cheap():
    """A model that keeps emitting a lone continuation byte must not hold text back (and
    grow its decode window) forever: after a few tokens the U+FFFD is final."""
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return bytes(ids).decode("utf-8", errors="replace")

    detok = IncrementalDetokenizer(Counting(), [104, 105])
    released = "".join(detok.step([0x80]) for _ in range(200))
    assert released.count("\ufffd") >= 190
    assert max(calls) <= 16  # the window stays small


# ---- the byte tokenizer's O(1) detokenizer -----------------------------------------------
PRESET_VOCAB = 600  # bytes, printable stand-ins above 255, three special tokens at the top


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, PRESET_VOCAB - 1), max_size=80), st.booleans(), st.randoms(use_true_random=False))
def test_byte_detokenizer_equals_full_decode_for_any_ids(output_ids, skip_special, rng):
    tokenizer = PresetByteTokenizer(PRESET_VOCAB)
    detok = make_detokenizer(tokenizer, tokenizer.encode("prompt 世"), skip_special)
    assert isinstance(detok, ByteDetokenizer)
    text = "".join(detok.step(chunk) for chunk in split_randomly(output_ids, rng)) + detok.flush()
    assert text == detok.output_text == tokenizer.decode(output_ids, skip_special_tokens=skip_special)


def test_byte_detokenizer_holds_an_incomplete_character_and_special_tokens_follow_the_flag():
    tokenizer = PresetByteTokenizer(PRESET_VOCAB)
    detok = make_detokenizer(tokenizer, [], skip_special_tokens=False)
    emoji = list("🙂".encode())
    assert [detok.step([b]) for b in emoji] == ["", "", "", "🙂"]
    assert detok.step([tokenizer.eos_token_id]) == "<|endoftext|>"
    assert make_detokenizer(tokenizer, [], skip_special_tokens=True).step([tokenizer.eos_token_id]) == ""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        detok.step([PRESET_VOCAB])


def test_other_tokenizers_get_the_window_detokenizer():
    assert isinstance(make_detokenizer(ByteTokenizer(), [1, 2]), IncrementalDetokenizer)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, PRESET_VOCAB - 1), max_size=60), st.booleans())
def test_step_token_equals_step_of_one_token(output_ids, skip_special):
    """The engine's per-token fast path (`step_token`) releases exactly what `step([id])` does,
    for both detokenizers, including characters split across tokens and special tokens."""
    tokenizer = PresetByteTokenizer(PRESET_VOCAB)
    for make in (lambda: make_detokenizer(tokenizer, [1, 2], skip_special),
                 lambda: IncrementalDetokenizer(tokenizer, [1, 2], skip_special)):
        fast, slow = make(), make()
        assert [fast.step_token(t) for t in output_ids] == [slow.step([t]) for t in output_ids]
        assert fast.flush() == slow.flush() and fast.output_text == slow.output_text
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_detokenizer(tokenizer, []).step_token(PRESET_VOCAB)


def test_the_detokenizer_cost_script_runs_on_a_tokenizer_it_trains(monkeypatch, capsys):
    """scripts/detokenizer_cost.py (the real-tokenizer figures in BENCHMARKS.md) trains a
    byte-level BPE here, runs both detokenizers over the same tokens and gets the same text."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "detokenizer_cost.py"
    spec = importlib.util.spec_from_file_location("detokenizer_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["detokenizer_cost.py", "--requests", "2", "--steps", "12", "--vocab", "300"])
    module.main()
    out = capsys.readouterr().out
    assert "IncrementalDetokenizer:" in out and "same text as the window detokenizer: True" in out
