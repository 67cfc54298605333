"""Incremental detokenization and stop strings.

A tokenizer with a piece table (every token a fixed byte string: roseray's byte tokenizer, a
Hugging Face byte-level BPE one) gets ByteDetokenizer, an incremental UTF-8 decoder over the
tokens' bytes. Any other gets IncrementalDetokenizer: text is produced by decoding a small
window of recent token ids twice, with and without the new ones, and taking the difference
(the prefix/read offsets of vLLM and HF's TextStreamer): decoding the window from a few
tokens back keeps the tokenizer's word-boundary handling (leading spaces, merged bytes) the
same as a full decode, and the cost per token stays O(window), not O(length). While the
decoded tail ends with U+FFFD, a multi-byte character is still incomplete and nothing is
released. When `decode` cleans up spaces last (" ." -> "."), the windows are decoded without
it and SpaceCleanUp applies it to the released text as it streams.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the first output token
MAX_HELD_TOKENS = 8  # past this many held tokens, text before the last few is checked for release
KEEP_HELD_TOKENS = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 tokens


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class SpaceCleanUp:
    """A space clean-up that `decode` applies to its whole text (Hugging Face's
    clean_up_tokenization: " ." -> ".", " 's" -> "'s", " n't" -> "n't", ...), applied to
    streamed text with exactly the same result.

    The clean-up is a chain of replacements whose patterns each start with a space and span at
    most 4 characters, and it only deletes spaces. So no match, at any stage of the chain, can
    reach across a cut that has no space among the 3 characters before it: the clean-up of
    the whole is the clean-ups of the parts between such cuts, joined. `push` releases the
    cleaned text up to the last such cut and keeps the rest for later; `flush` releases it all.
    """

    __slots__ = ("_clean_up", "_pending")

    def __init__(self, clean_up: Callable[[str], str]) -> None:
        self._clean_up = clean_up
        self._pending = ""

    def push(self, text: str) -> str:
        pending = self._pending + text
        cut = last_safe_cut(pending)
        self._pending = pending[cut:]
        return self._clean_up(pending[:cut]) if cut else ""

    def flush(self) -> str:
        text, self._pending = self._clean_up(self._pending), ""
        return text


def last_safe_cut(text: str) -> int:
    """The largest cut of `text` (0..len) with no space among the 3 characters before it
    (text before `text` was released at such a cut: it adds none)."""
    end = len(text)
    while True:
        space = text.rfind(" ", 0, end)
        if space < 0 or end - space > 3:
            return end
        end = space


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, a step at a time.

    `step(new_token_ids)` returns the text those tokens finalised ("" while a character is
    incomplete); `output_text` is everything released so far; `flush()` releases what is
    still held back (an incomplete character at the very end decodes to U+FFFD).
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        clean_up = getattr(tokenizer, "space_clean_up", lambda: None)()
        self._spaces = SpaceCleanUp(clean_up) if clean_up is not None else None  # windows decode without it
        self._decode_options = {"skip_special_tokens": skip_special_tokens}
        if self._spaces is not None:
            self._decode_options["clean_up_spaces"] = False
        # The window: token ids from the start of the last released chunk (context) to the end.
        self._window_ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window_ids)  # window ids before this are already released
        self._context_text: str | None = None  # decode of window[:read_offset], cached
        self.output_text = ""

    def step_token(self, token_id: int) -> str:
        return self.step([token_id])

    def step(self, new_token_ids: list[int]) -> str:
        self._window_ids.extend(new_token_ids)
        context_text = self._decoded_context()
        window_text = self._decode(self._window_ids)
        if len(window_text) <= len(context_text):
            return ""
        if window_text.endswith(REPLACEMENT_CHAR):
            return self._release_final_part(window_text, context_text)
        return self._release(window_text[len(context_text):])

    def _release_final_part(self, window_text: str, context_text: str) -> str:
        """The tail may be the first bytes of a character: hold it. But a model can emit
        invalid UTF-8 forever; then release all but the last few tokens once their text is
        final (decoding them alone gives a prefix of the whole), so the window stays small."""
        if len(self._window_ids) - self._read_offset <= MAX_HELD_TOKENS:
            return ""
        split = len(self._window_ids) - KEEP_HELD_TOKENS
        head_text = self._decode(self._window_ids[:split])
        if len(head_text) <= len(context_text) or not window_text.startswith(head_text):
            return ""  # a character straddles the split: keep holding
        return self._release(head_text[len(context_text):], upto=split)

    def flush(self) -> str:
        """Release whatever is held back; call once when the request finishes."""
        window_text = self._decode(self._window_ids)
        context_text = self._decoded_context()
        text = self._release(window_text[len(context_text):]) if len(window_text) > len(context_text) else ""
        if self._spaces is not None:
            held = self._spaces.flush()
            self.output_text += held
            text += held
        return text

    def _release(self, new_text: str, upto: int | None = None) -> str:
        # The chunk just released (window ids up to `upto`) becomes the next context.
        upto = len(self._window_ids) if upto is None else upto
        self._window_ids, self._read_offset = self._window_ids[self._read_offset:], upto - self._read_offset
        self._context_text = None
        if self._spaces is not None:
            new_text = self._spaces.push(new_text)
        self.output_text += new_text
        return new_text

    def _decoded_context(self) -> str:
        if self._context_text is None:
            self._context_text = self._decode(self._window_ids[:self._read_offset])
        return self._context_text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, **self._decode_options)


class ByteDetokenizer:
    """The incremental detokenizer of a tokenizer with a piece table (the byte tokenizer of
    the random presets; a Hugging Face byte-level BPE tokenizer, tokenizer.byte_level_pieces;
    a SentencePiece-style one, tokenizer.sentencepiece_pieces, whose table gives the text in
    context): every token is a fixed byte string, so an incremental UTF-8 decoder gives
    exactly `decode(output ids)` at O(1) per token (a held incomplete character is the decoder's own
    state). A token that is plain ASCII while no character is held skips the decoder (a
    table lookup). An id past the table raises ValueError, or, with `skip_unknown_ids` (as
    a Hugging Face tokenizer's decode does with the ids a model's padded vocabulary has
    beyond it), gives no text."""

    __slots__ = ("_pieces", "_ascii", "_decoder", "_holding", "_skip_unknown", "output_text")

    def __init__(self, pieces: list[bytes], ascii_text: list[str | None], skip_unknown_ids: bool = False) -> None:
        self._pieces, self._ascii, self._skip_unknown = pieces, ascii_text, skip_unknown_ids
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._holding = False  # the decoder holds the first bytes of a character
        self.output_text = ""

    def step_token(self, token_id: int) -> str:
        """`step([token_id])` without the list (the per-token hot path)."""
        if not self._holding and 0 <= token_id < len(self._ascii):
            text = self._ascii[token_id]
            if text is not None:
                self.output_text += text
                return text
        return self.step([token_id])

    def step(self, new_token_ids: list[int]) -> str:
        if len(new_token_ids) == 1 and not self._holding:
            token_id = new_token_ids[0]
            if 0 <= token_id < len(self._ascii):
                text = self._ascii[token_id]
                if text is not None:
                    self.output_text += text
                    return text
        pieces = self._pieces
        if any(not 0 <= t < len(pieces) for t in new_token_ids):
            if not self._skip_unknown:
                raise ValueError(f"a token id of {new_token_ids} is outside the vocabulary [0, {len(pieces)})")
            new_token_ids = [t for t in new_token_ids if 0 <= t < len(pieces)]
        text = self._decoder.decode(b"".join([pieces[t] for t in new_token_ids]))
        self._holding = bool(self._decoder.getstate()[0])
        self.output_text += text
        return text

    def flush(self) -> str:
        text = self._decoder.decode(b"", True)
        self._holding = False
        self.output_text += text
        return text


def detokenizes_by_table(tokenizer, skip_special_tokens: bool = True) -> bool:
    """Whether make_detokenizer gives `tokenizer` the table detokenizer (its table is built
    now: a 150k vocabulary takes a fraction of a second, better spent before any request)."""
    piece_table = getattr(tokenizer, "piece_table", None)
    return piece_table is not None and piece_table(skip_special_tokens) is not None


def prepare_detokenization(tokenizer) -> str:
    """Builds now what make_detokenizer will use for `tokenizer` (its piece tables, skipping
    special tokens or not: ~0.3 s for a 150k vocabulary, which would stall a step; its space
    clean-up check) and says how its requests are detokenized (for the startup log)."""
    by_table = detokenizes_by_table(tokenizer)
    detokenizes_by_table(tokenizer, skip_special_tokens=False)
    if by_table:
        return "by table"
    clean_up = getattr(tokenizer, "space_clean_up", lambda: None)()
    return "by windowed decode calls" + (", space clean-up streamed" if clean_up is not None else "")


def make_detokenizer(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
    """The fastest exact incremental detokenizer for `tokenizer`: by table when it has a
    piece table (`piece_table(skip_special_tokens)` not None), else by windowed decodes."""
    piece_table = getattr(tokenizer, "piece_table", None)
    pieces = piece_table(skip_special_tokens) if piece_table is not None else None
    if pieces is not None:
        return ByteDetokenizer(pieces, tokenizer.ascii_table(skip_special_tokens),
                               skip_unknown_ids=getattr(tokenizer, "skips_unknown_ids", False))
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)


def find_stop_string(output_text: str, num_new_chars: int, stops: list[str],
                     include_in_output: bool) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last `num_new_chars` characters.

    A match may start in older text (a stop split across steps) but must end in the new
    text: one ending earlier was found by an earlier call. Returns (cut, stop): keep
    `output_text[:cut]`, which ends just before the stop string, or just after it when
    `include_in_output`. On equal starts the stop listed first wins.
    """
    if num_new_chars <= 0:
        return None
    new_text_start = len(output_text) - num_new_chars
    best: tuple[int, str] | None = None
    for stop in stops:
        search_from = max(0, new_text_start - len(stop) + 1)
        start = output_text.find(stop, search_from)
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    if best is None:
        return None
    start, stop = best
    return (start + len(stop) if include_in_output else start), stop
