"""Tool calls a grammar forced: `tool_choice: "required"` (the whole output is a JSON array of
calls) and a named `tool_choice` (the whole output is the named tool's arguments object).

The same rules as the formats (tool_calls.py): arguments are rewritten as they arrive to
json.dumps(value, ensure_ascii=False) form, so streamed pieces and the whole-text parse agree.
The grammar leaves only one way to go wrong, being cut off (max_tokens).
"""

from __future__ import annotations

from roseray.openai_api.json_stream import WHITESPACE, JsonError
from roseray.openai_api.tool_calls import (
    CallArrayStream,
    CallJson,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    new_tool_call_id,
)


class RequiredToolCallsStream(CallArrayStream):
    """The whole output is `[{"name": <tool name>, "parameters": {...}}, ...]` ("arguments" is read
    too). Calls complete as their objects close; a call cut off is not a call; text that is not
    the array (there is none under the grammar) is content."""

    def __init__(self) -> None:
        super().__init__()
        self._array = "open"
        self._in_content = False

    def _step(self, char: str) -> None:
        if self._in_content:
            self._write_content(char)
        elif not self._array_char(char):  # the array failed on this character
            self._in_content = True
            self._write_content(char)
        elif not self._array:  # the array closed
            self._in_content = True

    def _end(self) -> None:
        if self._array:
            self._end_array()


def parse_required_tool_calls(text: str) -> list[ToolCall]:
    """The calls of a whole `tool_choice: "required"` output (those complete, if it was cut off)."""
    stream = RequiredToolCallsStream()
    stream.feed(text)
    stream.finish()
    return stream.tool_calls


class NamedToolCallStream(ToolCallStream):
    """The whole output is the arguments object of the tool `name`. The first delta carries the
    id and the name; every later piece of text is an arguments piece. From where the text stops
    being JSON (text after the object) it is passed on as it is; a cut-off object's arguments
    are its rewritten text so far (without a number or escape the cut split). The call is in
    `tool_calls` once its object is complete, and always after finish()."""

    def __init__(self, name: str) -> None:
        self._call = CallJson(name)
        self._id = new_tool_call_id()
        self._header_sent = False
        self._args: list[str] = []
        self._passing_raw = False  # the text stopped being JSON: the rest is passed on as it is
        self._finished = False

    def feed(self, text: str) -> StreamDelta:
        deltas = self._header()
        call = self._call
        raw = text if self._passing_raw else ""
        if not self._passing_raw:
            for position, char in enumerate(text):
                try:
                    if not call.json.done:
                        call.json.push(char)
                        continue
                    if char in WHITESPACE:
                        continue
                except JsonError:
                    pass
                self._passing_raw = True
                raw = text[position:]
                break
        piece = "".join(call.pending_args) + raw
        call.pending_args.clear()
        if piece:
            self._args.append(piece)
            deltas.append(ToolCallDelta(0, arguments=piece))
        return StreamDelta("", deltas)

    def finish(self) -> StreamDelta:
        self._finished = True
        return StreamDelta("", self._header())

    def _header(self) -> list[ToolCallDelta]:
        if self._header_sent:
            return []
        self._header_sent = True
        return [ToolCallDelta(0, self._id, self._call.name)]

    @property
    def tool_calls(self) -> list[ToolCall]:
        if not (self._finished or (self._call.json.done and not self._passing_raw)):
            return []
        return [ToolCall(self._call.name, "".join(self._args), self._id)]
