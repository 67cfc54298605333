"""A load generator's connection: one keep-alive HTTP/1.1 connection that sends a request
already encoded as bytes and stamps each SSE event of the streamed answer when its end
arrives.

Why not an HTTP client library: the serving comparison (roseray.bench.serving) puts a burst
of streams on the wire from a few client processes and compares the burst's tok/s (first
send to last token) with an in-process engine that is handed all its requests at once. A
client library spends enough CPU per request before its bytes leave that a process's share
of a burst goes out spread over milliseconds: a spread that real clients, each on its own
machine, do not have, counted against the server. Here a request is one `transport.write`
of prebuilt bytes. Reading is as lean: each read's bytes are de-chunked and split into
whole events, and only the usage event is parsed as JSON.

What it speaks: a request per connection at a time (no pipelining); answers framed by
`Transfer-Encoding: chunked` (a stream) or `Content-Length` (an error or a plain answer);
no trailers, no 1xx answers, no compression. An answer with `Connection: close`, or a
connection the server closed, ends the connection: the next `request` raises.

    connection = await StreamConnection.open("127.0.0.1", 8000)
    answer = await connection.request(encode_post("127.0.0.1", 8000, "/v1/completions", body))
    answer.status, answer.event_times, answer.completion_tokens
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

MAX_HEAD_BYTES = 64 * 1024
MAX_ERROR_BODY_BYTES = 4096  # what an answer that is not a stream keeps of its body (for the message)


def encode_post(host: str, port: int, path: str, body: dict, headers: dict[str, str] | None = None) -> bytes:
    """An HTTP/1.1 keep-alive POST of `body` as JSON, as bytes to send as they are."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n{extra}\r\n")
    return head.encode("latin-1") + payload


@dataclass
class StreamedAnswer:
    """One answer: its status and headers (names lower-cased), the arrival time
    (`time.monotonic`) of each content event (an SSE `data: {...}` event other than the
    usage event, which has `"choices":[]`), the usage event's `completion_tokens`, and the
    start of the body when the answer was not a stream."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    event_times: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    body: bytes = b""


class StreamConnection(asyncio.Protocol):
    """See the module's docstring. Not thread-safe; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._answer: StreamedAnswer | None = None
        self._future: asyncio.Future | None = None
        self._start_answer()

    def _start_answer(self) -> None:
        """The parser's state at the start of an answer."""
        self._buffer = b""  # bytes not parsed yet (head, chunk framing)
        self._in_head = True
        self._chunked = False
        self._left = 0  # chunked: bytes left of the current chunk (-1: its CRLF is next); else: of the body
        self._events_tail = b""  # an event still arriving
        self._keep_alive = True

    @classmethod
    async def open(cls, host: str, port: int) -> StreamConnection:
        _, connection = await asyncio.get_running_loop().create_connection(cls, host, port)
        return connection

    def request(self, data: bytes) -> asyncio.Future[StreamedAnswer]:
        """Send `data` (a whole request); the future gives the answer once it ended."""
        if self.closed or self.transport is None:
            raise ConnectionError("the connection is closed")
        if self._future is not None and not self._future.done():
            raise RuntimeError("a request is still answering on this connection")
        self._future = asyncio.get_running_loop().create_future()
        self._answer = StreamedAnswer()
        self._start_answer()
        self.transport.write(data)
        return self._future

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # ---- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._future is not None and not self._future.done():
            self._future.set_exception(ConnectionError(f"the server closed the connection mid-answer ({exc})"))

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if self._future is None or self._future.done():
            self._fail(ConnectionError("bytes from the server outside an answer"))
            return
        self._buffer += data
        try:
            if self._in_head and not self._parse_head():
                return
            if self._chunked:
                self._read_chunks(now)
            else:
                self._read_sized()
        except ValueError as error:
            self._fail(error)

    # ---- parsing -------------------------------------------------------------------------
    def _parse_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise ValueError("the answer's head is too long")
            return False
        head, self._buffer = self._buffer[:end].decode("latin-1"), self._buffer[end + 4:]
        status_line, *lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x answer: {status_line[:80]!r}")
        answer = self._answer
        answer.status = int(parts[1])
        for line in lines:
            name, _, value = line.partition(":")
            answer.headers[name.strip().lower()] = value.strip()
        self._keep_alive = answer.headers.get("connection", "").lower() != "close"
        self._chunked = "chunked" in answer.headers.get("transfer-encoding", "").lower()
        if not self._chunked:
            if "content-length" not in answer.headers:
                raise ValueError("an answer without Content-Length or chunked framing")
            self._left = int(answer.headers["content-length"])
        self._in_head = False
        return True

    def _read_sized(self) -> None:
        piece, self._buffer = self._buffer[:self._left], self._buffer[self._left:]
        self._left -= len(piece)
        self._keep_body(piece)
        if self._left == 0:
            self._finish()

    def _read_chunks(self, now: float) -> None:
        buffer = self._buffer
        while buffer:
            if self._left > 0:  # inside a chunk's data
                piece, buffer = buffer[:self._left], buffer[self._left:]
                self._left -= len(piece)
                self._on_body(piece, now)
                if self._left == 0:
                    self._left = -1  # its closing CRLF comes next
                continue
            if self._left < 0:
                if len(buffer) < 2:
                    break
                if buffer[:2] != b"\r\n":
                    raise ValueError("a chunk does not end in CRLF")
                buffer, self._left = buffer[2:], 0
                continue
            line_end = buffer.find(b"\r\n")
            if line_end < 0:
                if len(buffer) > 1024:
                    raise ValueError("a chunk-size line is too long")
                break
            size = int(buffer[:line_end].split(b";", 1)[0], 16)
            if size == 0:  # the last chunk: then (no trailers) an empty line
                if len(buffer) < line_end + 4:
                    break
                if buffer[line_end + 2:line_end + 4] != b"\r\n":
                    raise ValueError("trailers are not supported")
                self._buffer = buffer[line_end + 4:]
                self._finish()
                return
            buffer, self._left = buffer[line_end + 2:], size
        self._buffer = buffer

    def _on_body(self, piece: bytes, now: float) -> None:
        answer = self._answer
        if answer.status != 200:
            self._keep_body(piece)
            return
        events = (self._events_tail + piece).split(b"\n\n")
        self._events_tail = events.pop()  # an event still arriving (usually b"")
        for event in events:
            if not event.startswith(b"data: {"):
                continue  # [DONE], comments
            if b'"choices":[]' in event:  # the usage event: the only one parsed
                answer.completion_tokens = json.loads(event[6:])["usage"]["completion_tokens"]
            else:
                answer.event_times.append(now)

    def _keep_body(self, piece: bytes) -> None:
        answer = self._answer
        answer.body += piece[:max(0, MAX_ERROR_BODY_BYTES - len(answer.body))]

    def _finish(self) -> None:
        if self._buffer:
            self._fail(ValueError("bytes after the end of the answer"))
            return
        if not self._keep_alive:
            self.close()
        self._future.set_result(self._answer)

    def _fail(self, error: BaseException) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_exception(error)
        self.close()
