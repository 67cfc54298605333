"""A request's async stream of deltas.

`RequestStream` is what `AsyncLLMEngine.add_request` returns: an async iterator of lists
of `RequestDelta` (everything that arrived since the previous read, so a slow reader
gets them batched). It ends after the delta with `finished=True`; closing it earlier
aborts the request. Instead of reading it, a caller may `attach` callbacks that get each
delta inside the engine's hand-off, and a flush at its end (roseray.openai_api.sse_writer
streams SSE that way).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from roseray.engine.outputs import RequestDelta


class RequestStream:
    """The deltas of one request, as an async iterator of lists (every delta that arrived
    since the previous read, so a slow reader gets them batched). Ends after the delta
    with `finished=True`. Closing it before then aborts the request."""

    __slots__ = ("request_id", "_abort", "_loop", "_buffer", "_waiter", "_error", "_finished",
                 "_on_delta", "_on_error", "_on_flush", "_flush_due")

    def __init__(self, request_id: str, abort: Callable[[str], None], loop: asyncio.AbstractEventLoop) -> None:
        """`abort(request_id)`: called when the stream is closed before its request finished."""
        self.request_id = request_id
        self._abort = abort
        self._loop = loop
        self._buffer: list[RequestDelta] = []
        # The reader's wake-up: a bare future made when it has to wait (cheaper than an
        # asyncio.Event per stream).
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._on_delta: Callable[[RequestDelta], None] | None = None  # attached: deltas go here, not to _buffer
        self._on_error: Callable[[BaseException], None] | None = None
        self._on_flush: Callable[[], None] | None = None
        self._flush_due = False  # deltas went to _on_delta since the last _on_flush

    @property
    def finished(self) -> bool:
        return self._finished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[RequestDelta]:
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if self._finished:
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        deltas, self._buffer = self._buffer, []
        return deltas

    async def aclose(self) -> None:
        """Stop reading; aborts the request if it has not finished."""
        self.close()

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._abort(self.request_id)
            self._wake()  # a reader waiting in __anext__ ends

    def attach(self, on_delta: Callable[[RequestDelta], None], on_error: Callable[[BaseException], None],
               on_flush: Callable[[], None]) -> None:
        """Deliver every delta by calling `on_delta` from the engine's hand-off (one call per
        delta, on the event loop), then `on_flush` once at the end of a hand-off that brought
        any (so that a consumer may write them together), and a failure by `on_error`,
        instead of through iteration. What arrived before is delivered (and flushed) now.
        The callbacks must not raise."""
        buffered, self._buffer = self._buffer, []
        self._on_delta, self._on_error, self._on_flush = on_delta, on_error, on_flush
        for delta in buffered:
            on_delta(delta)
        if buffered:
            on_flush()
        if self._error is not None and not (buffered and buffered[-1].finished):
            on_error(self._error)

    # called on the event loop by AsyncLLMEngine
    def _push(self, delta: RequestDelta) -> bool:
        """Take one delta of a hand-off. True when the stream wants `_flush()` at the end of
        this hand-off (its first delta since the last flush, when attached)."""
        if delta.finished:
            self._finished = True
        if self._on_delta is not None:
            self._on_delta(delta)
            if self._flush_due:
                return False
            self._flush_due = True
            return True
        self._buffer.append(delta)
        self._wake()
        return False

    def _flush(self) -> None:
        """The hand-off that pushed deltas here is over."""
        self._flush_due = False
        self._on_flush()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._finished = True
        if self._on_error is not None:
            self._on_error(error)
            return
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
