"""The model's reasoning, split from its answer: the `<think>...</think>` form of Qwen3 and
DeepSeek-R1 (EngineConfig.reasoning_parser names the model family).

- qwen3: the output may open `<think>` (hybrid Qwen3 with thinking on) or not (thinking off:
  the template put an empty think block into the prompt; then all is content). An output
  with `</think>` but no `<think>` had the block opened by the template (Qwen3 thinking-only
  models): the text before `</think>` is reasoning. Unless the stream is told how the prompt
  ends (starts_in_reasoning), an output that does not open `<think>` is held back until
  `</think>` or its end decides which it was.
- deepseek_r1: the template opens `<think>`, so the output starts in reasoning (an opening
  `<think>` in the output is dropped); all up to `</think>` is reasoning, all of it if
  `</think>` never comes.
The tags are dropped, and so are newlines at the start and end of the reasoning and at the
start of the content after `</think>` (Qwen3 writes "<think>\\n...\\n</think>\\n\\n"); other
text is kept as it is. A tag split across chunks is held back until it is known. Splitting
a whole text is streaming it in one piece, so both agree for any split.

starts_in_reasoning (stream and split): True, the prompt opened `<think>` (see
prompt_opens_reasoning); False, it did not (the output may still open it); None, the
family's default (qwen3: undecided, deepseek_r1: True).
"""

from __future__ import annotations

from typing import ClassVar

from roseray.config import REASONING_PARSERS as REASONING_PARSER_NAMES
from roseray.openai_api.tool_calls import split_partial_tag

START_TAG, END_TAG = "<think>", "</think>"
_WHITESPACE = " \t\n\r"
_NEWLINES = "\r\n"


class ReasoningStream:
    """One output's streaming state: feed() and finish() return (reasoning piece, content piece)."""

    def __init__(self, start: str) -> None:
        # "lead": only whitespace and the start of <think> so far; then "reasoning", "content", or
        # "undecided" (everything held: reasoning if </think> comes, content if the output ends)
        self._mode = "lead"
        self._start = start  # where the lead goes without <think>: "reasoning", "content" or "undecided"
        self._held = ""  # the start of a tag (or the lead, or the undecided text)
        self._newlines = ""  # reasoning's newlines held: dropped if </think> follows
        self._reasoning_started = False
        self._content_started = False
        self._reasoning: list[str] = []
        self._content: list[str] = []

    @property
    def reasoning_ended(self) -> bool:
        """The output is past its reasoning (or had none): what follows is content."""
        return self._mode == "content"

    def feed(self, text: str) -> tuple[str, str]:
        for char in text:
            self._step(char)
        return self._take()

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._mode == "lead":
            self._leave_lead(held, at_end=True)
        elif self._mode == "reasoning":
            self._write_reasoning(held)
            self._newlines = ""
        elif self._mode == "undecided":
            self._content.append(held)
        self._mode = "content"
        return self._take()

    def _take(self) -> tuple[str, str]:
        pieces = "".join(self._reasoning), "".join(self._content)
        self._reasoning, self._content = [], []
        return pieces

    def _step(self, char: str) -> None:
        mode = self._mode
        if mode == "content":
            self._write_content(char)
        elif mode == "reasoning":
            held = self._held + char
            if held == END_TAG:
                self._held = ""
                self._end_reasoning()
                return
            safe, self._held = split_partial_tag(held, END_TAG)
            if safe:
                self._write_reasoning(safe)
        elif mode == "lead":
            held = self._held + char
            tag = held.lstrip(_WHITESPACE)
            if tag == START_TAG:
                self._held, self._mode = "", "reasoning"
            elif START_TAG.startswith(tag):
                self._held = held
            else:
                self._held = ""
                self._leave_lead(held, at_end=False)
        else:  # undecided
            self._held += char
            if self._held.endswith(END_TAG):
                reasoning, self._held = self._held[:-len(END_TAG)], ""
                self._write_reasoning(reasoning)
                self._end_reasoning()

    def _leave_lead(self, held: str, at_end: bool) -> None:
        """The output does not open <think>: its start goes where the parser says."""
        if self._start == "reasoning":
            self._mode = "reasoning"
            if not at_end:  # the held text may end with the start of </think>
                for char in held:
                    self._step(char)
                return
            self._write_reasoning(held)
        elif self._start == "content" or at_end:
            self._mode = "content"
            self._content_started = True  # an output without reasoning is content as it is
            self._content.append(held)
        else:
            self._mode = "undecided"
            self._held = ""
            for char in held:
                self._step(char)

    def _write_reasoning(self, text: str) -> None:
        if not self._reasoning_started:
            text = text.lstrip(_NEWLINES)
            if not text:
                return
            self._reasoning_started = True
        text = self._newlines + text
        kept = text.rstrip(_NEWLINES)
        self._newlines = text[len(kept):]
        if kept:
            self._reasoning.append(kept)

    def _end_reasoning(self) -> None:
        self._newlines = ""
        self._mode = "content"

    def _write_content(self, text: str) -> None:
        if not self._content_started:
            text = text.lstrip(_NEWLINES)
            if not text:
                return
            self._content_started = True
        self._content.append(text)


class ReasoningParser:
    """The <think>...</think> form; a family says where an output starts (`starts_in_reasoning`)."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = START_TAG
    end_tag: ClassVar[str] = END_TAG  # where the reasoning ends (the engine applies constraints after it)
    starts_in_reasoning: ClassVar[bool | None]

    def stream(self, starts_in_reasoning: bool | None = None) -> ReasoningStream:
        if starts_in_reasoning is None:
            starts_in_reasoning = self.starts_in_reasoning
        start = {True: "reasoning", False: "content", None: "undecided"}[starts_in_reasoning]
        return ReasoningStream(start)

    def split(self, text: str, starts_in_reasoning: bool | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where empty."""
        stream = self.stream(starts_in_reasoning)
        reasoning, content = stream.feed(text)
        end_reasoning, end_content = stream.finish()
        return (reasoning + end_reasoning) or None, (content + end_content) or None

    @classmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        """Whether a rendered prompt ends inside an open think block (the template opened it)."""
        start = prompt.rfind(cls.start_tag)
        return start >= 0 and not prompt[start + len(cls.start_tag):].strip(_WHITESPACE)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = None


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}
assert tuple(REASONING_PARSERS) == REASONING_PARSER_NAMES, "a parser for every name EngineConfig accepts"


def make_reasoning_parser(name: str) -> ReasoningParser:
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}")
    return parser()
