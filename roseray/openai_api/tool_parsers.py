"""`tool_choice: auto`: the tool calls a model writes in its own format, found in its text
(ServerConfig.tool_call_parser names the format).

- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, with text around them; the content is the text outside the tags. A call
  whose object is complete but whose closing tag never comes (output cut) still counts.
- llama3_json (Llama 3.1/3.2): the whole output, after an optional `<|python_tag|>`, is
  `{"name": ..., "parameters" | "arguments": {...}}`, or several joined by `;`. An output
  that starts otherwise is content; text after the calls is content.
- mistral: `[TOOL_CALLS]` then `[{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` (repeated for several calls); the content is the text
  outside them.
A name not among the request's tools is still a call: the client decides. What a call
that is not well formed becomes, and how streaming agrees with extract(): tool_calls.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from roseray.config import TOOL_CALL_PARSERS
from roseray.openai_api.forced_tool_calls import (
    NamedToolCallStream,
    RequiredToolCallsStream,
    parse_required_tool_calls,
)
from roseray.openai_api.json_stream import WHITESPACE
from roseray.openai_api.tool_calls import (
    CallArrayStream,
    CallTextStream,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    new_tool_call_id,
    split_partial_tag,
)

__all__ = [
    "TOOL_PARSERS", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
    "NamedToolCallStream", "RequiredToolCallsStream", "StreamDelta", "ToolCall", "ToolCallDelta",
    "ToolCallStream", "ToolParser", "make_tool_parser", "new_tool_call_id", "parse_required_tool_calls",
]


class ToolParser(ABC):
    """One format, for one request's tools (OpenAI's [{"type": "function", "function": {...}}])."""

    name: ClassVar[str]

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = list(tools or ())
        self.tool_names = frozenset(
            tool["function"]["name"] for tool in self.tools
            if isinstance(tool, dict) and isinstance(tool.get("function"), dict) and "name" in tool["function"])

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output and the text outside them."""
        stream = self.stream()
        content = stream.feed(text).content + stream.finish().content
        return ExtractedToolCalls(content if content.strip(WHITESPACE) else None, stream.tool_calls)

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A new streaming state, for one output."""


# -- hermes --

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


class HermesToolCallStream(CallTextStream):
    def __init__(self) -> None:
        super().__init__()
        self._mode = "content"  # "content", "call" (its JSON), "after" (its JSON read: the closing tag)
        self._held = ""  # the start of a tag, held back

    def _step(self, char: str) -> None:
        if self._mode == "call":
            if self._call_char(char):
                if self._call.json.done:
                    self._mode = "after"
                return
            self._mode = "content"
        elif self._mode == "after":
            if self._after_call(char):
                return
            self._held = ""
            self._fail_call()
            self._mode = "content"
        held = self._held + char
        if held == _HERMES_OPEN:
            self._held = ""
            self._raw = [_HERMES_OPEN]
            self._begin_call()
            self._mode = "call"
            return
        safe, self._held = split_partial_tag(held, _HERMES_OPEN)
        if safe:
            self._write_content(safe)

    def _after_call(self, char: str) -> bool:
        if not self._held and char in WHITESPACE:
            self._raw.append(char)
            return True
        held = self._held + char
        if not _HERMES_CLOSE.startswith(held):
            return False
        self._raw.append(char)
        self._held = held
        if held == _HERMES_CLOSE:
            self._held = ""
            self._complete_call()
            self._mode = "content"
        return True

    def _end(self) -> None:
        if self._mode == "content":
            self._write_content(self._held)
        elif self._mode == "call":
            self._fail_call()
        else:  # the object is complete; the closing tag was cut off
            self._complete_call()
        self._held, self._mode = "", "content"


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> HermesToolCallStream:
        return HermesToolCallStream()


# -- llama3_json --

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolCallStream(CallTextStream):
    def __init__(self) -> None:
        super().__init__()
        # "start" (only whitespace so far), "tag" (reading <|python_tag|>), "call", "after" (a call
        # read: ";" or the end), "content" (everything from here is content)
        self._mode = "start"
        self._held = ""

    def _step(self, char: str) -> None:
        mode = self._mode
        if mode == "content":
            self._write_content(char)
        elif mode == "call":
            if self._call_char(char):
                if self._call.json.done:
                    self._complete_call()
                    self._mode = "after"
            else:
                self._mode = "content"
                self._write_content(char)
        elif mode == "start":
            if char in WHITESPACE:
                self._write_content(char)
            elif char == "{":
                self._start_call("")
                self._step(char)
            elif char == _PYTHON_TAG[0]:
                self._mode, self._held = "tag", char
            else:
                self._mode = "content"
                self._write_content(char)
        elif mode == "tag":
            held = self._held + char
            if held == _PYTHON_TAG:
                self._held = ""
                self._start_call(_PYTHON_TAG)
            elif _PYTHON_TAG.startswith(held):
                self._held = held
            else:
                self._held, self._mode = "", "content"
                self._write_content(held)
        elif char in WHITESPACE:  # after a call
            self._held += char
        elif char == ";":
            self._held = ""
            self._start_call(";")
        else:
            self._mode = "content"
            self._write_content(self._held + char)
            self._held = ""

    def _start_call(self, raw: str) -> None:
        self._raw = [raw] if raw else []
        self._begin_call()
        self._mode = "call"

    def _end(self) -> None:
        if self._mode == "tag":
            self._write_content(self._held)
        elif self._mode == "call":
            self._fail_call()
        self._held, self._mode = "", "content"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> Llama3JsonToolCallStream:
        return Llama3JsonToolCallStream()


# -- mistral --

_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def _is_name_char(char: str) -> bool:
    return char.isalnum() or char in "_-."


class MistralToolCallStream(CallArrayStream):
    def __init__(self) -> None:
        super().__init__()
        # "content"; after [TOOL_CALLS]: "open" (the array's "[" or a name), "array", "name",
        # "args_tag" (reading [ARGS]), "args" (the arguments object)
        self._mode = "content"
        self._held = ""
        self._name: list[str] = []

    def _step(self, char: str) -> None:
        mode = self._mode
        if mode == "array":
            if self._array_char(char):
                if not self._array:
                    self._mode = "content"
                return
            self._mode = "content"
        elif mode == "args":
            if self._call_char(char):
                if self._call.json.done:
                    self._complete_call()
                    self._mode = "content"
                return
            self._mode = "content"
        elif mode != "content":
            if self._before_args(char):
                return
            self._fail_call()
            self._mode = "content"
        held = self._held + char
        if held == _MISTRAL_CALLS:
            self._held = ""
            self._raw = [_MISTRAL_CALLS]
            self._mode = "open"
            return
        safe, self._held = split_partial_tag(held, _MISTRAL_CALLS)
        if safe:
            self._write_content(safe)

    def _before_args(self, char: str) -> bool:
        """Reads [TOOL_CALLS]'s "[" or name and [ARGS]; False where the text is not a call."""
        mode = self._mode
        if mode == "open":
            if char in WHITESPACE:
                pass
            elif char == "[":
                self._mode, self._array = "array", "open"
                return self._array_char(char)
            elif _is_name_char(char):
                self._mode, self._name = "name", [char]
            else:
                return False
        elif mode == "name":
            if _is_name_char(char):
                self._name.append(char)
            elif char == _MISTRAL_ARGS[0]:
                self._mode, self._held = "args_tag", char
            else:
                return False
        else:  # args_tag
            held = self._held + char
            if not _MISTRAL_ARGS.startswith(held):
                self._held = ""
                return False
            self._held = held
            if held == _MISTRAL_ARGS:
                self._held = ""
                self._raw.append(char)
                self._mode = "args"
                self._begin_call("".join(self._name))
                return True
        self._raw.append(char)
        return True

    def _end(self) -> None:
        if self._mode == "content":
            self._write_content(self._held)
        elif self._mode == "array":
            self._end_array()
        else:
            self._fail_call()
        self._held, self._mode = "", "content"


class MistralToolParser(ToolParser):
    name = "mistral"

    def stream(self) -> MistralToolCallStream:
        return MistralToolCallStream()


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
assert tuple(TOOL_PARSERS) == TOOL_CALL_PARSERS, "a parser for every name ServerConfig accepts"


def make_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return parser(tools)
