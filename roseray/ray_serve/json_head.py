"""The JSON document at the head of a request body that was cut short: HAProxy forwards at most
its buffer of a body to the Router, and a prompt's head still names its prefix. `loads_or_head`
parses a whole body, or closes a cut one after its last complete value."""

from __future__ import annotations

import json
import re
from typing import Any

# JSON tokens: a string, an unterminated string running to the end (a cut body), punctuation,
# a number or literal. Whitespace between tokens is skipped by finditer.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"[^"\\]*(?:\\.[^"\\]*)*\\?\Z|[\[\]{},:]|[^\s\[\]{},:"]+')
_HEX_TAIL = re.compile(r'u[0-9a-fA-F]{0,3}\Z')
MAX_HEAD_CHARS = 32 * 1024  # of a cut body, what is parsed: more than the affinity chain can use


def loads_or_head(body: bytes) -> tuple[Any, int]:
    """(json.loads(body), len(body)); for a body cut short (HAProxy forwards at most its
    buffer), the JSON of its first MAX_HEAD_CHARS up to the last complete value, its open
    string, arrays and objects closed, and how many bytes that read: the prompt's head
    survives a cut inside the prompt. (None, 0) when nothing usable is left."""
    if not body:
        return None, 0
    try:
        return json.loads(body), len(body)
    except ValueError:
        pass
    text = body[:MAX_HEAD_CHARS].decode("utf-8", errors="ignore")
    closed = _close_json_head(text)
    if closed is None:
        return None, 0
    try:
        return json.loads(closed), min(len(body), MAX_HEAD_CHARS)
    except ValueError:
        return None, 0


def _close_json_head(text: str) -> str | None:
    """`text` (a JSON document cut short) cut back to its last complete value and closed.

    A cut inside a string value keeps the string's head (less a half escape); a cut inside
    a key, a number or a literal drops that member or element."""
    stack: list[str] = []  # open "{" / "["
    expect_key: list[bool] = []  # per open container: an object's next string is a key
    cut = None  # (index, open containers there) just after the last complete value
    for match in _JSON_TOKEN.finditer(text):
        token, end = match.group(), match.end()
        c = token[0]
        if c == '"':
            is_key = bool(stack) and stack[-1] == "{" and expect_key[-1]
            if len(token) == 1 or token[-1] != '"' or end == len(text) and _unterminated(token):
                if is_key or not stack:
                    break
                return text[:match.start()] + _drop_half_escape(token) + '"' + _closers(stack)
            if stack and not is_key:
                cut = (end, tuple(stack))
        elif c in "{[":
            stack.append(c)
            expect_key.append(c == "{")
        elif c in "}]":
            if not stack:
                return None
            stack.pop()
            expect_key.pop()
            if not stack:
                return text[:end]
            cut = (end, tuple(stack))
        elif c == ",":
            if stack and stack[-1] == "{":
                expect_key[-1] = True
        elif c == ":":
            if stack and stack[-1] == "{":
                expect_key[-1] = False
        else:  # a number or a literal: complete only if something follows it
            if end == len(text):
                break
            if stack:
                cut = (end, tuple(stack))
    if cut is None:
        return None
    index, open_stack = cut
    return text[:index] + _closers(list(open_stack))


def _drop_half_escape(head: str) -> str:
    """An unterminated string's head less a trailing half escape (a lone backslash, or a
    backslash-u with fewer than four hex digits), so that a closing quote ends it."""
    unicode_head = _HEX_TAIL.search(head[-4:])
    end = len(head) - (len(unicode_head.group()) if unicode_head else 0)
    run = end - len(head[:end].rstrip("\\"))
    if run % 2 == 1:  # the last backslash escapes what was cut off
        return head[:end - 1]
    return head


def _unterminated(token: str) -> bool:
    """Whether a string token that ends the text lacks its closing quote (its last quote
    is escaped by an odd run of backslashes, or it is the opening quote itself)."""
    body = token[1:]
    if not body.endswith('"'):
        return True
    run = len(body) - 1 - len(body[:-1].rstrip("\\"))
    return run % 2 == 1


def _closers(stack: list[str]) -> str:
    return "".join("}" if c == "{" else "]" for c in reversed(stack))
