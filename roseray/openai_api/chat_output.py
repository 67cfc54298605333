"""What a chat request's output becomes in the response: its reasoning split off (the
engine's reasoning_parser), and tool calls found in what follows (the request's ToolPlan:
the server's tool_call_parser for "auto", the JSON list of a "required" choice, the
arguments object of a named one). Whole (`message`) or streamed (`stream`: one delta dict
per piece of text, in OpenAI's shape).

Only requests that need it get one: a plain chat request (no reasoning parser, no tools
parsed) never reaches this module, so its per-token path stays that of responses.py.
"""

from __future__ import annotations

import secrets
from typing import Any

from roseray.openai_api.reasoning_parsers import make_reasoning_parser
from roseray.openai_api.tool_parsers import (
    NamedToolCallStream,
    RequiredToolCallsStream,
    make_tool_parser,
    parse_required_tool_calls,
)
from roseray.openai_api.tools import ToolPlan


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call_body(call) -> dict[str, Any]:
    return {"id": call.id or tool_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _finish_reason(plan: ToolPlan, called: bool, finish_reason: str | None) -> str | None:
    """"tool_calls" when the output made calls and ended by itself (for a required or named
    choice, whose grammar ends it: unless max_tokens cut it)."""
    if not called:
        return finish_reason
    if finish_reason == "stop" or (plan.mode in ("required", "named") and finish_reason not in ("length", "abort",
                                                                                                 "error")):
        return "tool_calls"
    return finish_reason


def merge_delta(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """`into` with `more` after it: text fields concatenated, tool-call deltas appended."""
    for key, value in more.items():
        into[key] = into[key] + value if key in into else value
    return into


class ChatOutput:
    """One chat request's output shaping (see the module doc)."""

    def __init__(self, plan: ToolPlan, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 include_reasoning: bool = True) -> None:
        self.plan = plan
        self.tool_call_parser = tool_call_parser if plan.mode == "auto" else None
        self.reasoning_parser = reasoning_parser
        self.include_reasoning = include_reasoning

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole response's message and its finish_reason."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = make_reasoning_parser(self.reasoning_parser).split(text)
        calls = []
        mode = self.plan.mode
        if mode == "auto" and content:
            extracted = make_tool_parser(self.tool_call_parser).extract(content)
            content, calls = extracted.content, list(extracted.tool_calls)
        elif mode == "required" and content:
            try:
                calls = list(parse_required_tool_calls(content))
            except ValueError:  # cut short by max_tokens: not a whole list; the text stays content
                calls = []
            content = None if calls else content
        elif mode == "named":
            calls = [_NamedCall(self.plan.name, content or "")]
            content = None
        message: dict[str, Any] = {"role": "assistant", "content": content or None if calls else content}
        if calls:
            message["tool_calls"] = [_call_body(call) for call in calls]
        if self.reasoning_parser is not None and self.include_reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message, _finish_reason(self.plan, bool(calls), finish_reason)

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


class _NamedCall:
    __slots__ = ("name", "arguments", "id")

    def __init__(self, name: str, arguments: str) -> None:
        self.name, self.arguments, self.id = name, arguments, None


class ChatOutputStream:
    """A streamed request's output shaping: `feed` each new piece of text, `finish` once."""

    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self.reasoning = (make_reasoning_parser(output.reasoning_parser).stream()
                          if output.reasoning_parser is not None else None)
        mode = output.plan.mode
        if mode == "auto":
            self.tools = make_tool_parser(output.tool_call_parser).stream()
        elif mode == "required":
            self.tools = RequiredToolCallsStream()
        elif mode == "named":
            self.tools = NamedToolCallStream(output.plan.name)
        else:
            self.tools = None
        self.called = False
        self._ids: dict[int, str] = {}

    def feed(self, text: str) -> dict[str, Any]:
        """The delta of one new piece of text (empty while a parser holds text back)."""
        if self.reasoning is None:
            return self._content(text, {})
        reasoning, content = self.reasoning.feed(text)
        return self._content(content, self._reasoning(reasoning, {}))

    def finish(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The last delta (what the parsers still held) and the stream's finish_reason."""
        delta: dict[str, Any] = {}
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            self._content(content, self._reasoning(reasoning, delta))
        if self.tools is not None:
            self._tool_delta(self.tools.finish(), delta)
        return delta, _finish_reason(self.output.plan, self.called, finish_reason)

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
        calls = []
        for call in stream_delta.tool_calls or ():
            self.called = True
            entry: dict[str, Any] = {"index": call.index}
            function: dict[str, Any] = {}
            if call.index not in self._ids:  # a call's first delta: its id, type and name
                self._ids[call.index] = entry["id"] = call.id or tool_call_id()
                entry["type"] = "function"
                function["name"] = call.name
                function["arguments"] = call.arguments or ""
            elif call.arguments:
                function["arguments"] = call.arguments
            entry["function"] = function
            calls.append(entry)
        if calls:
            merge_delta(delta, {"tool_calls": calls})
        return delta
