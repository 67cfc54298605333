"""A request's async stream of deltas, and the errors the async engine raises to callers.

`RequestStream` is what `AsyncLLMEngine.add_request` returns: an async iterator of lists
of `RequestDelta` (everything that arrived since the previous read, so a slow reader
gets them batched). It ends after the delta with `finished=True`; closing it earlier
aborts the request. Instead of reading it, a caller may `attach` callbacks that get each
delta inside the engine's hand-off (roseray.server.sse_writer streams SSE that way).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable

from roseray.engine.request import RequestDelta

if TYPE_CHECKING:
    from roseray.engine.async_engine import AsyncLLMEngine


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at `max_waiting_requests` (HTTP 429)."""

    def __init__(self, num_waiting: int, limit: int, retry_after_s: int) -> None:
        super().__init__(f"the engine queue is full ({num_waiting} waiting, limit {limit}); retry later")
        self.retry_after_s = retry_after_s


class EngineUnavailableError(RuntimeError):
    """The engine does not take requests: not started, draining, stopped or dead (HTTP 503)."""


class EngineRequestError(RuntimeError):
    """The engine finished a request with an error (the model step failed)."""



class RequestStream:
    """The deltas of one request, as an async iterator of lists (every delta that arrived
    since the previous read, so a slow reader gets them batched). Ends after the delta
    with `finished=True`. Closing it before then aborts the request."""

    __slots__ = ("request_id", "_owner", "_buffer", "_ready", "_admitted", "_error", "_finished", "_on_delta",
                 "_on_error")

    def __init__(self, request_id: str, owner: "AsyncLLMEngine", loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._owner = owner
        self._buffer: list[RequestDelta] = []
        self._ready = asyncio.Event()
        self._admitted: asyncio.Future = loop.create_future()
        self._error: BaseException | None = None
        self._finished = False
        self._on_delta: Callable[[RequestDelta], None] | None = None  # attached: deltas go here, not to _buffer
        self._on_error: Callable[[BaseException], None] | None = None

    @property
    def finished(self) -> bool:
        return self._finished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> list[RequestDelta]:
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if self._finished:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        deltas, self._buffer = self._buffer, []
        return deltas

    async def aclose(self) -> None:
        """Stop reading; aborts the request if it has not finished."""
        self.close()

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._owner._abort(self.request_id)
            self._ready.set()  # a reader waiting in __anext__ ends

    def attach(self, on_delta: Callable[[RequestDelta], None], on_error: Callable[[BaseException], None]) -> None:
        """Deliver every delta by calling `on_delta` from the engine's hand-off (one call per
        delta, on the event loop) and a failure by `on_error`, instead of through iteration.
        What arrived before is delivered now. The callbacks must not raise."""
        buffered, self._buffer = self._buffer, []
        self._on_delta, self._on_error = on_delta, on_error
        for delta in buffered:
            on_delta(delta)
        if self._error is not None and not (buffered and buffered[-1].finished):
            on_error(self._error)

    # called on the event loop by AsyncLLMEngine
    def _push(self, delta: RequestDelta) -> None:
        if delta.finished:
            self._finished = True
        if self._on_delta is not None:
            self._on_delta(delta)
            return
        self._buffer.append(delta)
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._finished = True
        if not self._admitted.done():
            self._admitted.set_exception(error)
        if self._on_error is not None:
            self._on_error(error)
            return
        self._ready.set()
