"""One JSON value read a character at a time and rewritten, as it arrives, in the form
json.dumps(value, ensure_ascii=False) gives it.

Tool-call parsers stream a call's arguments as the model writes them and must end with
the same text as parsing the whole output: rewriting token by token makes both one
function of the text. The rewrite drops insignificant whitespace, writes ", " and ": "
between members, re-escapes strings as json.dumps does (\\u00e9 -> é, \\/ -> /, a raw
newline inside a string -> \\n) and writes numbers as json.dumps writes json.loads's
number (1E2 -> 100.0, -0 -> 0). Where json.dumps would not give valid JSON the token is
kept: a number too large for a float (json.dumps would write Infinity) and a lone UTF-16
surrogate escape (written back as its escape, so the text stays encodable). Duplicate keys
are all kept (json.loads keeps the last one).

Raw control characters inside strings are accepted (json.loads(strict=False)): models
write literal newlines into code arguments. NaN, Infinity, comments and trailing commas
are not JSON and raise JsonError.
"""

from __future__ import annotations

import json
import math
import re
from json.encoder import encode_basestring  # json.dumps's string escaping (ensure_ascii=False)
from typing import Protocol

WHITESPACE = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?\Z")
_LITERALS = ("true", "false", "null")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")

# what the next significant character may be
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE, _END = range(7)


class JsonError(ValueError):
    """The text is not (the start of) one JSON value."""


class JsonListener(Protocol):
    def text(self, member: str | None, piece: str) -> None:
        """A piece of the rewritten value; `member` is the key of the top-level object's member
        whose value it belongs to (None for the top-level object's own braces, keys and
        separators, and for every piece when the top-level value is not an object)."""

    def member_end(self, member: str) -> None:
        """The value of the top-level object's member `member` is complete."""


class JsonRewriter:
    """Reads one JSON value a character at a time (push), handing the rewritten text to a
    listener as soon as each piece is certain. `done` once the value is complete."""

    def __init__(self, listener: JsonListener, object_only: bool = False) -> None:
        self._listener = listener
        self._object_only = object_only  # the top-level value must be an object
        self._stack: list[str] = []  # open containers: "{" or "["
        self._expect = _VALUE
        self._scalar = ""  # "" | "string" | "number" | "literal"
        self._token = ""  # a number's or literal's characters so far
        self._escape: str | None = None  # None outside an escape; "" right after "\"; "u12" in a \u escape
        self._high_surrogate = 0  # a \uD800-\uDBFF escape waiting for its low half
        self._is_key = False  # the string being read is an object key
        self._key_chars: list[str] | None = None  # a top-level member's key as it is decoded
        self._member_key: str | None = None  # the top-level member key read last
        self._member: str | None = None  # the top-level member whose value is being read
        self.done = False

    def push(self, char: str) -> bool:
        """Reads one character: True if it belongs to the value, False if the value was already
        complete before it (only a top-level number learns it is complete from the character
        after it). Raises JsonError where the text stops being JSON."""
        if self._scalar == "string":
            self._string_char(char)
            return True
        if self._scalar == "number":
            if char in _NUMBER_CHARS:
                self._token += char
                return True
            self._end_number()
            if self.done:
                return False
        elif self._scalar == "literal":
            self._literal_char(char)
            return True
        if self.done:
            return False
        if char in WHITESPACE:
            return True
        expect = self._expect
        if expect in (_VALUE, _VALUE_OR_CLOSE):
            if char == "]" and expect == _VALUE_OR_CLOSE:
                self._close("[", char)
            else:
                self._start_value(char)
        elif expect in (_KEY, _KEY_OR_CLOSE):
            if char == '"':
                self._is_key = True
                if len(self._stack) == 1:
                    self._key_chars = []
                self._start_string()
            elif char == "}" and expect == _KEY_OR_CLOSE:
                self._close("{", char)
            else:
                raise JsonError(f"expected a key, got {char!r}")
        elif expect == _COLON:
            if char != ":":
                raise JsonError(f"expected ':', got {char!r}")
            self._write(": ")
            self._expect = _VALUE
        elif expect == _COMMA_OR_CLOSE:
            if char == ",":
                self._write(", ")
                self._expect = _KEY if self._stack[-1] == "{" else _VALUE
            elif char in "}]":
                self._close("{" if char == "}" else "[", char)
            else:
                raise JsonError(f"expected ',' or a closing bracket, got {char!r}")
        return True

    def end(self) -> None:
        """The text has ended: completes a top-level number; JsonError if the value is incomplete."""
        if self._scalar == "number" and not self._stack:
            self._end_number()
        if not self.done:
            raise JsonError("the JSON value is incomplete")

    # -- values --

    def _start_value(self, char: str) -> None:
        if self._object_only and not self._stack and char != "{":
            raise JsonError(f"expected a JSON object, got {char!r}")
        if len(self._stack) == 1 and self._stack[0] == "{":
            self._member = self._member_key
        if char in "{[":
            self._stack.append(char)
            self._write(char)
            self._expect = _KEY_OR_CLOSE if char == "{" else _VALUE_OR_CLOSE
        elif char == '"':
            self._is_key = False
            self._start_string()
        elif char == "-" or char.isdigit():
            self._scalar, self._token = "number", char
        elif char in "tfn":
            self._scalar, self._token = "literal", char
        else:
            raise JsonError(f"expected a JSON value, got {char!r}")

    def _value_done(self) -> None:
        self._scalar = ""
        if not self._stack:
            self.done = True
            self._expect = _END
            return
        self._expect = _COMMA_OR_CLOSE
        if len(self._stack) == 1 and self._stack[0] == "{":
            member, self._member = self._member, None
            self._listener.member_end(member)

    def _close(self, opener: str, char: str) -> None:
        if self._stack[-1] != opener:
            raise JsonError(f"{char!r} does not close {self._stack[-1]!r}")
        self._write(char)
        self._stack.pop()
        self._value_done()

    def _write(self, piece: str) -> None:
        self._listener.text(self._member, piece)

    # -- scalars --

    def _end_number(self) -> None:
        token = self._token
        if not _NUMBER.match(token):
            raise JsonError(f"{token!r} is not a JSON number")
        if "." in token or "e" in token or "E" in token:
            value = float(token)
            written = token if math.isinf(value) else repr(value)
        else:
            try:
                written = str(int(token))
            except ValueError:  # more digits than int() converts
                written = token
        self._write(written)
        self._value_done()

    def _literal_char(self, char: str) -> None:
        self._token += char
        token = self._token
        if token in _LITERALS:
            self._write(token)
            self._value_done()
        elif not any(literal.startswith(token) for literal in _LITERALS):
            raise JsonError(f"{token!r} is not a JSON literal")

    def _start_string(self) -> None:
        self._scalar = "string"
        self._escape = None
        self._high_surrogate = 0
        self._write('"')

    def _string_char(self, char: str) -> None:
        escape = self._escape
        if escape is None:
            if char == "\\":
                self._escape = ""
            elif char == '"':
                self._end_string()
            else:
                self._decoded(char)
        elif escape == "":
            if char == "u":
                self._escape = "u"
            elif char in _SIMPLE_ESCAPES:
                self._escape = None
                self._decoded(_SIMPLE_ESCAPES[char])
            else:
                raise JsonError(f"invalid escape \\{char}")
        else:
            if char not in _HEX:
                raise JsonError(f"invalid \\u escape: {escape + char!r}")
            escape += char
            if len(escape) < 5:
                self._escape = escape
                return
            self._escape = None
            self._code_point(int(escape[1:], 16))

    def _code_point(self, code: int) -> None:
        if 0xDC00 <= code <= 0xDFFF and self._high_surrogate:
            high, self._high_surrogate = self._high_surrogate, 0
            self._decoded(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
        elif 0xD800 <= code <= 0xDBFF:
            self._flush_surrogate()
            self._high_surrogate = code
        elif 0xDC00 <= code <= 0xDFFF:
            self._flush_surrogate()
            self._emit_string_text(f"\\u{code:04x}")
        else:
            self._decoded(chr(code))

    def _flush_surrogate(self) -> None:
        if self._high_surrogate:
            self._emit_string_text(f"\\u{self._high_surrogate:04x}")
            self._high_surrogate = 0

    def _decoded(self, char: str) -> None:
        self._flush_surrogate()
        self._emit_string_text(encode_basestring(char)[1:-1])

    def _emit_string_text(self, piece: str) -> None:
        if self._key_chars is not None:
            self._key_chars.append(piece)
        self._write(piece)

    def _end_string(self) -> None:
        self._flush_surrogate()
        self._write('"')
        self._scalar = ""
        if self._is_key:
            self._is_key = False
            if self._key_chars is not None:
                # the key as json.dumps writes it; decoded for the listener
                self._member_key = _decode_key("".join(self._key_chars))
                self._key_chars = None
            self._expect = _COLON
        else:
            self._value_done()


def _decode_key(written: str) -> str:
    """A key's decoded text from its json.dumps form (only the escapes json.dumps writes)."""
    return written if "\\" not in written else json.loads(f'"{written}"')
