"""Tool calls found in a model's text: the shapes the API returns (whole and streamed) and the
machinery every format's stream shares.

One rule makes streaming and whole-text parsing agree: a format is one character-driven
state machine, and parsing the whole text is feeding it all at once (ToolParser.extract).
So for every way of splitting a text into chunks:
- the content pieces concatenate to the whole-text content ("" where that is None);
- a call's argument pieces concatenate to its final `arguments`, the arguments object
  rewritten by json_stream (json.dumps(value, ensure_ascii=False) form) as it arrives;
- a call's first delta (index, id, name, arguments "") goes out as soon as its name is
  complete, its arguments follow in pieces; indexes count 0, 1, 2... in order.
A call that turns out malformed (not JSON, no name, arguments not an object, cut off)
is content: its whole text, from its opening tag, goes out as content. Its deltas
already sent cannot be taken back: its index is then never completed (it is not in
`tool_calls`), and the next call takes the next index.
Content that is whitespace only is held back until visible text follows (and dropped if
none does, and when a call starts): the content of a text that is only calls is None.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from roseray.openai_api.json_stream import WHITESPACE, JsonError, JsonRewriter

_ALPHANUMERIC = string.ascii_letters + string.digits
ARGUMENT_KEYS = ("arguments", "parameters")  # the member holding a call's arguments, by format


def new_tool_call_id() -> str:
    """"call_" and 24 random letters and digits, the shape of OpenAI's ids."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


@dataclass(slots=True)
class ToolCall:
    """One complete call."""

    name: str
    arguments: str  # JSON text of the arguments object, as json.dumps(obj, ensure_ascii=False) writes it
    id: str = field(default_factory=new_tool_call_id)


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None  # the text outside the calls; None when it is empty or whitespace only
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one call, in OpenAI's streaming shape."""

    index: int
    id: str | None = None  # set, with name, on the call's first delta only
    name: str | None = None
    arguments: str = ""  # a piece of the arguments text; one index's pieces concatenate to it


@dataclass(slots=True)
class StreamDelta:
    content: str = ""  # plain text to send as content now (a chunk's content pieces, concatenated)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream(ABC):
    """One request's streaming state: feed the model's text as it comes, then finish."""

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """The next piece of the model's text (split anywhere)."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The output has ended: what was held back, resolved."""

    @property
    @abstractmethod
    def tool_calls(self) -> list[ToolCall]:
        """The calls completed so far."""


def split_partial_tag(text: str, tag: str) -> tuple[str, str]:
    """(safe, held): `held` is the longest end of `text` that may be the start of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return text[:-length], text[-length:]
    return text, ""


class CallJson:
    """One call's JSON, read as it arrives: an object {"name": ..., "arguments" | "parameters":
    {...}} (other members ignored), or, given the name, the arguments object alone."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self._bare = name is not None
        self.json = JsonRewriter(self, object_only=True)
        self._name_parts: list[str] = []
        self._args_member: str | None = None  # the member whose value is being read as the arguments
        self._args_seen = False
        self.pending_args: list[str] = []  # argument pieces not handed out yet

    def text(self, member: str | None, piece: str) -> None:
        if self._bare:
            self.pending_args.append(piece)
        elif member == "name":
            self._name_parts.append(piece)
        elif member in ARGUMENT_KEYS:
            if self._args_member is None:
                if self._args_seen:
                    raise JsonError("a call has one arguments object")
                if piece != "{":
                    raise JsonError("a call's arguments must be a JSON object")
                self._args_member, self._args_seen = member, True
            self.pending_args.append(piece)

    def member_end(self, member: str) -> None:
        if self._bare:
            return
        if member == "name":
            name = json.loads("".join(self._name_parts))
            if self.name is not None or not isinstance(name, str) or not name:
                raise JsonError("a call has one name, a non-empty string")
            self.name = name
        elif member in ARGUMENT_KEYS:
            self._args_member = None

    def object_end(self) -> None:
        """The object is complete: JsonError if it is not a call."""
        if self.name is None:
            raise JsonError("a call needs a name")
        if not self._args_seen and not self._bare:
            self.pending_args.append("{}")  # a call written without arguments takes none


class CallTextStream(ToolCallStream):
    """What the format streams share: content (held while blank), calls and their deltas.
    A format implements _step (one character) and _end (the output has ended)."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._blank = ""  # whitespace held back: no visible content has gone out yet
        self._visible = False
        self._deltas: list[ToolCallDelta] = []
        self._calls: list[ToolCall] = []
        self._call: CallJson | None = None
        self._raw: list[str] = []  # the current call's text so far: content if it fails
        self._index = -1  # the latest call index handed out
        self._call_id = ""
        self._header_sent = False
        self._args: list[str] = []  # the current call's argument pieces handed out

    @abstractmethod
    def _step(self, char: str) -> None: ...

    @abstractmethod
    def _end(self) -> None: ...

    def feed(self, text: str) -> StreamDelta:
        step = self._step
        for char in text:
            step(char)
        return self._take()

    def finish(self) -> StreamDelta:
        self._end()
        self._blank = ""
        return self._take()

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def _take(self) -> StreamDelta:
        delta = StreamDelta("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return delta

    def _write_content(self, text: str) -> None:
        if self._visible:
            self._content.append(text)
        elif (blank := self._blank + text).strip(WHITESPACE):
            self._content.append(blank)
            self._blank, self._visible = "", True
        else:
            self._blank = blank

    # -- one call --

    def _begin_call(self, name: str | None = None) -> None:
        """A call starts (its opening text is already in _raw)."""
        self._blank = ""  # whitespace before a call is not content
        self._call = CallJson(name)
        self._header_sent = False
        self._args = []
        self._sync_call()

    def _call_char(self, char: str) -> bool:
        """Reads a character of the call's JSON. False if the call failed on it: the call's text
        went out as content and the character is the caller's to read again."""
        call = self._call
        try:
            call.json.push(char)  # the top-level value is an object: its every character is its own
            if call.json.done:
                call.object_end()
        except JsonError:
            self._fail_call()
            return False
        self._raw.append(char)
        self._sync_call()
        return True

    def _sync_call(self) -> None:
        call = self._call
        if not self._header_sent:
            if call.name is None:
                return
            self._index += 1
            self._call_id = new_tool_call_id()
            self._deltas.append(ToolCallDelta(self._index, self._call_id, call.name))
            self._header_sent = True
        if call.pending_args:
            piece = "".join(call.pending_args)
            call.pending_args.clear()
            self._args.append(piece)
            last = self._deltas[-1] if self._deltas else None
            if last is not None and last.index == self._index and last.id is None:
                last.arguments += piece
            else:
                self._deltas.append(ToolCallDelta(self._index, arguments=piece))

    def _complete_call(self) -> None:
        self._calls.append(ToolCall(self._call.name, "".join(self._args), self._call_id))
        self._call = None
        self._raw = []

    def _fail_call(self) -> None:
        """The call's text is content after all."""
        self._call = None
        raw, self._raw = "".join(self._raw), []
        if raw:
            self._write_content(raw)


class CallArrayStream(CallTextStream):
    """Adds a JSON array of call objects, `[{...}, {...}]`, read inside a format's text."""

    def __init__(self) -> None:
        super().__init__()
        self._array = ""  # "" outside an array; "open": "[" expected; "first", "call", "next", "comma"

    def _array_char(self, char: str) -> bool:
        """False when the array is over (closed or failed: its text went out as content) and
        `char` is the caller's to read again; on a close, the "]" was the array's."""
        state = self._array
        if state == "call":
            if not self._call_char(char):
                self._array = ""
                return False
            if self._call.json.done:
                self._complete_call()
                self._array = "next"
            return True
        if char in WHITESPACE:
            self._raw.append(char)
            return True
        if state == "open" and char == "[":
            self._array = "first"
        elif state in ("first", "comma") and char == "{":
            self._array = "call"
            self._begin_call()
            return self._array_char(char)
        elif state in ("first", "next") and char == "]":
            self._array = ""
            self._raw = []
            return True
        elif state == "next" and char == ",":
            self._array = "comma"
        else:
            self._array = ""
            self._fail_call()
            return False
        self._raw.append(char)
        return True

    def _end_array(self) -> None:
        """The output ended inside an array: the calls complete so far stand; a cut call is content."""
        if self._array == "next":
            self._raw = []
        else:
            self._fail_call()
        self._array = ""
