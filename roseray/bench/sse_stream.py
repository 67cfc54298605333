"""One streamed OpenAI response, timed as the client sees it: SSE events from the raw
byte chunks as they arrive, then TTFT, every inter-chunk gap (ITL), E2E and token counts.

No HTTP client and no locust here, so that the parsing and the sample math are testable
on plain byte strings. Times are whatever `clock` returns (seconds; the caller passes the
clock it read just before sending the request).

A content chunk is a chunk that carries at least one new token: with
`stream_options.continuous_usage_stats` the server's running `completion_tokens` says so
exactly (a chunk whose token has no printable text yet still counts, and its token count
is known); without it, a chunk with non-empty text. ITL is the gap between consecutive
content chunks; a chunk may carry several tokens (see `chunk_tokens`), so a per-chunk gap
is not always a per-token gap.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

DONE = "[DONE]"

# Failure kinds: stable strings, so that failures group well (locust groups by message).
CUT = "stream cut"
NO_CONTENT = "no content"
NO_FINISH = "no finish_reason"
NO_USAGE = "no usage"
TOKEN_MISMATCH = "token count mismatch"
SHORT_OUTPUT = "short output"
ERROR_EVENT = "error event"
MALFORMED = "malformed event"


@dataclass
class StreamResult:
    """What one streamed response gave. `error` is None for a good stream; else `error`
    is one of the kinds above (or "HTTP <status>") and `detail` says what happened."""

    status: int = 200
    error: str | None = None
    detail: str = ""
    ttft: float | None = None  # s, request sent -> first content chunk
    e2e: float | None = None  # s, request sent -> last content chunk
    chunk_times: list[float] = field(default_factory=list)  # clock time of every content chunk
    chunk_tokens: list[int] | None = None  # tokens per content chunk (continuous usage only)
    prompt_tokens: int | None = None  # from the final usage
    completion_tokens: int | None = None  # from the final usage
    finish_reason: str | None = None
    num_events: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def itl(self) -> list[float]:
        """Every gap between consecutive content chunks (s)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than two tokens."""
        if self.ttft is None or self.e2e is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def fail(self, error: str, detail: str, status: int | None = None) -> StreamResult:
        self.error, self.detail = error, detail
        if status is not None:
            self.status = status
        return self


def body_chunks(raw, size: int = 65536) -> Iterator[bytes]:
    """The bytes of a response body as they arrive, whatever its framing (chunked or
    ended by the connection's close): `raw.read1` returns what is there, up to `size`,
    without waiting for more (urllib3's `stream()` would read a body without chunked
    framing to its end before returning anything)."""
    while True:
        data = raw.read1(size)
        if not data:
            return
        yield data


def sse_events(chunks: Iterable[bytes], clock: Callable[[], float] = time.perf_counter
               ) -> Iterator[tuple[float, str]]:
    """(arrival time, data) of each complete SSE event, as soon as its closing blank line
    arrives. Multi-line data is joined with "\\n"; comments (":...") and other fields are
    skipped. An event left unterminated when the chunks end is not yielded (the caller sees
    a stream without its [DONE] and calls it cut)."""
    buffer = b""
    data_lines: list[bytes] = []
    for chunk in chunks:
        if not chunk:
            continue
        now = clock()
        buffer += chunk
        if b"\n" not in chunk:
            continue
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if data_lines:
                    yield now, b"\n".join(data_lines).decode("utf-8", errors="replace")
                    data_lines = []
            elif line.startswith(b"data:"):
                value = line[5:]
                data_lines.append(value[1:] if value.startswith(b" ") else value)


class StreamTimer:
    """Feeds on the events of one response and builds its StreamResult."""

    def __init__(self, t_sent: float, *, expect_usage: bool = True, expected_tokens: int | None = None) -> None:
        self.result = StreamResult()
        self.t_sent = t_sent
        self.expect_usage = expect_usage
        self.expected_tokens = expected_tokens  # ignore_eos: the output length asked for
        self.done = False
        self.tokens_seen = 0  # running completion_tokens (continuous usage)
        self.continuous = False

    def on_event(self, t: float, data: str) -> bool:
        """Take one event; returns False when the stream failed (result.error is set)."""
        r = self.result
        r.num_events += 1
        if data == DONE:
            self.done = True
            return True
        try:
            body = json.loads(data)
        except ValueError:
            r.fail(MALFORMED, f"not JSON: {data[:80]!r}")
            return False
        if not isinstance(body, dict):
            r.fail(MALFORMED, f"not an object: {data[:80]!r}")
            return False
        if "error" in body:
            error = body["error"] if isinstance(body["error"], dict) else {"message": str(body["error"])}
            code = error.get("code")
            r.fail(ERROR_EVENT, f"{error.get('type') or 'error'}: {str(error.get('message', ''))[:200]}",
                   code if isinstance(code, int) else None)
            return False
        usage = body.get("usage")
        choices = body.get("choices") or []
        if not choices:
            if usage:  # the final usage chunk
                r.prompt_tokens = usage.get("prompt_tokens")
                r.completion_tokens = usage.get("completion_tokens")
            return True
        choice = choices[0]
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if choice.get("finish_reason"):
            r.finish_reason = choice["finish_reason"]
        new_tokens = 0
        if usage and usage.get("completion_tokens") is not None:
            self.continuous = True
            new_tokens = usage["completion_tokens"] - self.tokens_seen
            self.tokens_seen = usage["completion_tokens"]
        if new_tokens > 0 or (not self.continuous and text):
            self._content(t, new_tokens if self.continuous else None)
        return True

    def _content(self, t: float, num_tokens: int | None) -> None:
        r = self.result
        if not r.chunk_times:
            r.ttft = t - self.t_sent
        r.chunk_times.append(t)
        r.e2e = t - self.t_sent
        if num_tokens is not None:
            if r.chunk_tokens is None:
                r.chunk_tokens = []
            r.chunk_tokens.append(num_tokens)

    def finish(self, cut_by: BaseException | None = None) -> StreamResult:
        """The result once the body ended (or raised `cut_by`), with every check applied."""
        r = self.result
        if r.error is not None:
            return r
        n = len(r.chunk_times)
        if cut_by is not None:
            return r.fail(CUT, f"{type(cut_by).__name__} after {n} content chunks: {str(cut_by)[:160]}")
        if not self.done:
            return r.fail(CUT, f"the body ended without [DONE] after {n} content chunks")
        if n == 0:
            return r.fail(NO_CONTENT, f"[DONE] without any token ({r.num_events} events)")
        if r.finish_reason is None:
            return r.fail(NO_FINISH, f"no chunk carried a finish_reason ({n} content chunks)")
        if self.expect_usage and r.completion_tokens is None:
            return r.fail(NO_USAGE, "no usage chunk before [DONE] (stream_options.include_usage)")
        carried = sum(r.chunk_tokens) if r.chunk_tokens is not None else None
        if carried is not None and r.completion_tokens is not None and carried != r.completion_tokens:
            return r.fail(TOKEN_MISMATCH, f"chunks carried {carried} tokens, usage says {r.completion_tokens}")
        if self.expected_tokens is not None and r.completion_tokens is not None \
                and r.completion_tokens != self.expected_tokens:
            return r.fail(SHORT_OUTPUT, f"{r.completion_tokens} of {self.expected_tokens} tokens with ignore_eos "
                                        f"(finish_reason={r.finish_reason})")
        return r


def read_stream(chunks: Iterable[bytes], t_sent: float, *, clock: Callable[[], float] = time.perf_counter,
                expect_usage: bool = True, expected_tokens: int | None = None) -> StreamResult:
    """Read a whole SSE body (an iterator of byte chunks as they arrive) into a StreamResult.
    An exception from the iterator (connection reset, read timeout) makes a cut stream; the
    stream stops being read at the first failure."""
    timer = StreamTimer(t_sent, expect_usage=expect_usage, expected_tokens=expected_tokens)
    try:
        for t, data in sse_events(chunks, clock):
            if not timer.on_event(t, data):
                return timer.result
    except Exception as error:  # noqa: BLE001 - any transport error mid-body is a cut stream
        return timer.finish(cut_by=error)
    return timer.finish()
