"""What a chat request's output becomes in the response: its reasoning split off (the
engine's reasoning_parser), and tool calls found in what follows (the request's ToolPlan:
the server's tool_call_parser for "auto", the JSON list of a "required" choice, the
arguments object of a named one). Whole (`message`) or streamed (`stream`: one delta dict
per piece of text, in OpenAI's shape).

Only requests that need it get one: a plain chat request (no reasoning parser, no tools
parsed) never reaches this module, so its per-token path stays that of responses.py.
"""

from __future__ import annotations

from typing import Any

from roseray.openai_api.reasoning_parsers import ReasoningParser, make_reasoning_parser
from roseray.openai_api.tool_parsers import (
    NamedToolCallStream,
    RequiredToolCallsStream,
    ToolCallStream,
    make_tool_parser,
)
from roseray.openai_api.tools import ToolPlan


def starts_in_reasoning(parser: ReasoningParser, prompt: str) -> bool | None:
    """True when the prompt ends inside a think block the template opened; False when it ends
    right after one the template closed (thinking turned off, as Qwen3's enable_thinking=false
    does); else None (the parser's default for its model family)."""
    if parser.prompt_opens_reasoning(prompt):
        return True
    start = prompt.rfind(parser.start_tag)
    end = prompt.find(parser.end_tag, start) if start >= 0 else -1
    if end >= 0 and not prompt[end + len(parser.end_tag):].strip():
        return False
    return None


def _finish_reason(plan: ToolPlan, called: bool, finish_reason: str | None) -> str | None:
    """"tool_calls" when the output made calls and ended by itself (for a required or named
    choice, whose grammar ends it: unless max_tokens cut it)."""
    if not called:
        return finish_reason
    if finish_reason == "stop" or (plan.mode in ("required", "named") and finish_reason not in ("length", "abort",
                                                                                                 "error")):
        return "tool_calls"
    return finish_reason


def merge_delta(into: dict[str, Any], more: dict[str, str]) -> dict[str, Any]:
    """`into` with the text fields of `more` after its own."""
    for key, value in more.items():
        into[key] = into[key] + value if key in into else value
    return into


class ChatOutput:
    """One chat request's output shaping (see the module doc); `tools` in OpenAI's shape."""

    def __init__(self, plan: ToolPlan, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 include_reasoning: bool = True, tools: list[dict[str, Any]] | None = None,
                 prompt: str | None = None) -> None:
        self.plan = plan
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = make_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None
        # where the output starts, from how the rendered `prompt` ends (None: the parser's default)
        self.starts_in_reasoning = (starts_in_reasoning(self.reasoning_parser, prompt)
                                    if self.reasoning_parser is not None and prompt is not None else None)
        self.include_reasoning = include_reasoning
        self.tools = tools
        if plan.mode == "auto" and tool_call_parser is None:
            raise ValueError("tool_choice 'auto' needs a tool_call_parser")

    def tool_stream(self) -> ToolCallStream | None:
        """A new tool-call stream for one output, or None when its tools are not parsed."""
        mode = self.plan.mode
        if mode == "auto":
            return make_tool_parser(self.tool_call_parser, self.tools).stream()
        if mode == "required":
            return RequiredToolCallsStream()
        if mode == "named":
            return NamedToolCallStream(self.plan.name)
        return None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole response's message and its finish_reason: the text parsed as one piece,
        as the stream parses it in pieces."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.split(text, self.starts_in_reasoning)
        calls = []
        tools = self.tool_stream()
        if tools is not None:
            rest = tools.feed(content or "").content + tools.finish().content
            calls = tools.tool_calls
            content = rest if rest.strip() else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}
                                     for call in calls]
        if self.reasoning_parser is not None and self.include_reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message, _finish_reason(self.plan, bool(calls), finish_reason)

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


class ChatOutputStream:
    """A streamed request's output shaping: `feed` each new piece of text, `finish` once."""

    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self.reasoning = (output.reasoning_parser.stream(output.starts_in_reasoning)
                          if output.reasoning_parser is not None else None)
        self.tools = output.tool_stream()
        self._started: set[int] = set()  # calls whose first delta was sent

    def feed(self, text: str) -> dict[str, Any]:
        """The delta of one new piece of text (empty while a parser holds text back)."""
        if self.reasoning is None:
            return self._content(text, {})
        reasoning, content = self.reasoning.feed(text)
        return self._content(content, self._reasoning(reasoning, {}))

    def finish(self, finish_reason: str | None, delta: dict[str, Any]) -> str | None:
        """Adds to `delta` (the last one) what the parsers still held; the stream's finish_reason."""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            self._content(content, self._reasoning(reasoning, delta))
        if self.tools is not None:
            self._tool_delta(self.tools.finish(), delta)
        called = self.tools is not None and bool(self.tools.tool_calls)  # complete calls, not failed starts
        return _finish_reason(self.output.plan, called, finish_reason)

    def _reasoning(self, piece: str | None, delta: dict[str, Any]) -> dict[str, Any]:
        if piece and self.output.include_reasoning:
            merge_delta(delta, {"reasoning_content": piece, "reasoning": piece})
        return delta

    def _content(self, piece: str | None, delta: dict[str, Any]) -> dict[str, Any]:
        if not piece:
            return delta
        if self.tools is None:
            return merge_delta(delta, {"content": piece})
        return self._tool_delta(self.tools.feed(piece), delta)

    def _tool_delta(self, stream_delta, delta: dict[str, Any]) -> dict[str, Any]:
        if stream_delta is None:
            return delta
        if stream_delta.content:
            merge_delta(delta, {"content": stream_delta.content})
        entries = {entry["index"]: entry for entry in delta.get("tool_calls", ())}  # one entry per call a chunk
        for call in stream_delta.tool_calls or ():
            entry = entries.get(call.index)
            if entry is None:
                entry = entries[call.index] = {"index": call.index, "function": {}}
                delta.setdefault("tool_calls", []).append(entry)
            function = entry["function"]
            if call.index not in self._started:  # a call's first delta: its id, type and name
                self._started.add(call.index)
                entry["id"], entry["type"] = call.id, "function"
                entry["function"] = function = {"name": call.name, "arguments": function.get("arguments", "")}
            if call.arguments:
                function["arguments"] = function.get("arguments", "") + call.arguments
        return delta
