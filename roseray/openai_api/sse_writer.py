"""Streamed responses written from the engine's per-step hand-off.

AsyncLLMEngine hands each engine step's deltas to the event loop in one callback. A
streamed request answered by `EngineSSEResponse` has an `SSEWriter` attached to its
RequestStream, so its SSE bytes are built inside that callback and written at its end,
in one `send` however many steps' deltas it brought (the engine client reads every step
waiting for it, and hand-offs that queued up while the event loop was busy are taken
together): no task wakes up per request per step, the cost per streamed token is its
bytes, and a server that falls behind makes fewer, larger writes instead of more.

An ASGI `send` is a coroutine, but with uvicorn (also under Ray Serve's direct ingress) a
body `send` finishes without suspending whenever the socket is writable. `send_now` runs
it to completion on the spot and hands it to a task only when it does suspend (a client
that reads slower than tokens come); until that task is done the writer collects the next
steps' bytes and sends them together, so a slow client never holds up the other streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from roseray.engine.outputs import RequestDelta
from roseray.runtime.request_stream import RequestStream

RenderDelta = Callable[[RequestDelta], bytes]  # one delta -> its SSE bytes (a finished delta's close the stream)
RenderError = Callable[[BaseException], bytes]  # the stream failed -> the closing SSE bytes


def send_now(send: Callable[[dict], Awaitable[None]], message: dict) -> asyncio.Future | None:
    """Run `send(message)` now. None when it finished without suspending; otherwise a task
    that finishes it. Raises what `send` raised before suspending."""
    coro = send(message)
    try:
        awaited = coro.send(None)
    except StopIteration:
        return None
    return asyncio.ensure_future(_resume(coro, awaited))


async def _resume(coro, awaited) -> None:
    """Drive to its end a coroutine that suspended on `awaited` (the future it yielded, or
    None for a bare yield): wait for that, then step it again, as a task would."""
    try:
        while True:
            if awaited is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait((awaited,))  # its result or error is read by the coroutine itself
            awaited = coro.send(None)
    except StopIteration:
        return
    except asyncio.CancelledError:
        coro.close()
        raise


class SSEWriter:
    """Writes one request's stream as its deltas arrive; `done` resolves after the last
    write, or when writing failed (the client is gone: the request is then aborted)."""

    __slots__ = ("_send", "_render", "_render_error", "_stream", "done", "_pending", "_in_flight", "_ending",
                 "_last_sent")

    def __init__(self, send: Send, render: RenderDelta, render_error: RenderError, stream: RequestStream) -> None:
        self._send = send
        self._render = render
        self._render_error = render_error
        self._stream = stream
        self.done = asyncio.get_running_loop().create_future()
        self._pending: list[bytes] = []  # rendered, not sent yet (this hand-off's, or while a send was suspended)
        self._in_flight: asyncio.Future | None = None
        self._ending = False  # the last bytes are pending or sent: nothing more is rendered
        self._last_sent = False  # the send with more_body=False was made

    # called by the RequestStream (from the engine's hand-off)
    def on_delta(self, delta: RequestDelta) -> None:
        """Render one delta; it is written by the `flush` at the end of the hand-off."""
        if self._ending:
            return
        try:
            body = self._render(delta)
        except Exception as error:  # noqa: BLE001 - end the stream with an error event, never kill the hand-off
            self.on_error(error)
            return
        self._pending.append(body)
        self._ending = delta.finished

    def on_error(self, error: BaseException) -> None:
        if not self._ending:
            self._pending.append(self._render_error(error))
            self._ending = True
            self.flush()

    def flush(self) -> None:
        """Send what is pending in one write (unless a suspended send is still going: its
        completion sends it)."""
        if self._in_flight is not None or self._last_sent:
            return
        pending = self._pending
        if not pending and not self._ending:
            return
        body = pending[0] if len(pending) == 1 else b"".join(pending)
        self._pending = []
        if body or self._ending:  # deltas that rendered to nothing are not worth a write
            self._send_body(body)

    # ---- writing ---------------------------------------------------------------------------------
    def _send_body(self, body: bytes) -> None:
        last = self._last_sent = self._ending
        try:
            in_flight = send_now(self._send, {"type": "http.response.body", "body": body, "more_body": not last})
        except Exception:  # noqa: BLE001 - the connection is gone
            self.abandon()
            return
        if in_flight is None:
            if last:
                self._finish()
            return
        self._in_flight = in_flight
        in_flight.add_done_callback(self._sent)

    def _sent(self, in_flight: asyncio.Future) -> None:
        self._in_flight = None
        if in_flight.cancelled() or in_flight.exception() is not None:
            self.abandon()
        elif self._last_sent:
            self._finish()
        else:
            self.flush()

    def abandon(self) -> None:
        """The client is gone: write nothing more and abort the request."""
        self._ending = self._last_sent = True
        self._pending = []
        self._stream.close()  # aborts the request if it still runs
        self._finish()

    def on_disconnect(self, until_disconnect: asyncio.Future) -> None:
        """`until_disconnect` ended: the client is gone, unless the stream ended first (the
        task is then cancelled, or ends because the response is complete)."""
        if not self.done.done() and not until_disconnect.cancelled():
            self.abandon()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    async def wait_sent(self) -> None:
        """Until a suspended send has finished (the response must not return before it)."""
        while self._in_flight is not None:
            await asyncio.wait((self._in_flight,))


class EngineSSEResponse(Response):
    """`text/event-stream` response of one engine request, written by an SSEWriter from the
    engine's hand-off. Ends when the stream ends or the client disconnects (which aborts
    the request and frees its KV blocks); always closes the stream, then calls `on_end`."""

    media_type = "text/event-stream"

    def __init__(self, stream: RequestStream, render: RenderDelta, render_error: RenderError,
                 headers: dict[str, str] | None = None, on_end: Callable[[], None] | None = None) -> None:
        # Not Response.__init__: that would declare a content-length for the empty body.
        self.status_code = 200
        self.background = None
        self.stream = stream
        self.render = render
        self.render_error = render_error
        self.on_end = on_end
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = SSEWriter(send, self.render, self.render_error, self.stream)
        disconnect = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self.stream.attach(writer.on_delta, writer.on_error, writer.flush)
            disconnect = asyncio.ensure_future(until_disconnect(receive))
            # the client going away first abandons the writer, which ends `done` (a callback, not
            # asyncio.wait's waiter and callbacks on both: this runs once per streamed request)
            disconnect.add_done_callback(writer.on_disconnect)
            await writer.done
            await writer.wait_sent()
        finally:
            if disconnect is not None:
                disconnect.cancel()
            self.stream.close()
            if self.on_end is not None:
                self.on_end()


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client has gone away (or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass
