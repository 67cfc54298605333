"""SSE streams written from the engine's hand-off (roseray.openai_api.sse_writer): one write per
hand-off, sends that finish on the spot, sends that suspend (a slow client), failing sends,
disconnects."""

from __future__ import annotations

import asyncio

import pytest

from roseray.engine.outputs import RequestDelta
from roseray.openai_api.sse_writer import EngineSSEResponse, SSEWriter, send_now
from roseray.runtime.request_stream import RequestStream
from tests.waiting import async_wait_until


class Owner:
    """Stands in for AsyncLLMEngine: records aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def _abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def delta(text: str, finished: bool = False) -> RequestDelta:
    return RequestDelta("r", [1], text, finished, "length" if finished else None, None, 1, 1, None)


def render(d: RequestDelta) -> bytes:
    return d.new_text.encode() + (b"|end" if d.finished else b"")


def render_error(error: BaseException) -> bytes:
    return f"error:{error}".encode()


class Transport:
    """An ASGI send that completes at once unless `gate` is set (then it waits for it)."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.gate: asyncio.Event | None = None
        self.error: BaseException | None = None

    async def send(self, message: dict) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        self.messages.append(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body"]


def test_send_now_finishes_a_send_that_does_not_suspend_without_a_task():
    async def main():
        transport = Transport()
        assert send_now(transport.send, {"type": "http.response.body", "body": b"x"}) is None
        assert transport.bodies() == [b"x"]

    asyncio.run(main())


def test_send_now_hands_a_suspended_send_to_a_task_that_finishes_it():
    async def main():
        transport = Transport()
        transport.gate = asyncio.Event()
        task = send_now(transport.send, {"type": "http.response.body", "body": b"x"})
        assert task is not None and not transport.messages
        transport.gate.set()
        await task
        assert transport.bodies() == [b"x"]

    asyncio.run(main())


def test_send_now_raises_and_a_resumed_send_fails_with_the_senders_error():
    async def main():
        transport = Transport()
        transport.error = ConnectionResetError("gone")
        with pytest.raises(ConnectionResetError):
            send_now(transport.send, {"type": "http.response.body", "body": b"x"})
        transport.gate = asyncio.Event()
        task = send_now(transport.send, {"type": "http.response.body", "body": b"x"})
        transport.gate.set()
        with pytest.raises(ConnectionResetError):
            await task

    asyncio.run(main())


def _writer(transport: Transport, render=render, before_attach=lambda stream: None):
    owner = Owner()
    stream = RequestStream("r", owner._abort, asyncio.get_running_loop())
    before_attach(stream)
    writer = SSEWriter(transport.send, render, render_error, stream)
    stream.attach(writer.on_delta, writer.on_error, writer.flush)
    return owner, stream, writer


def hand_off(stream: RequestStream, *deltas: RequestDelta) -> None:
    """What AsyncLLMEngine does with one hand-off's deltas of this stream."""
    flush = [stream._push(d) for d in deltas]
    assert flush.count(True) == (1 if stream._on_delta is not None else 0)  # one flush per hand-off, when attached
    if any(flush):
        stream._flush()


def test_each_hand_off_is_one_write_made_at_its_end():
    async def main():
        transport = Transport()
        owner, stream, writer = _writer(transport)
        stream._push(delta("a"))
        assert transport.messages == []  # rendered, not written: more of the hand-off may follow
        stream._flush()
        assert transport.bodies() == [b"a"]  # written before the hand-off returned
        hand_off(stream, delta("b", finished=True))
        assert transport.messages[-1] == {"type": "http.response.body", "body": b"b|end", "more_body": False}
        assert writer.done.done() and writer.done.result() is None
        stream.close()
        assert owner.aborted == []  # finished: nothing to abort

    asyncio.run(main())


def test_several_steps_in_one_hand_off_are_one_write_of_the_same_bytes():
    steps = [delta("a"), delta("b"), delta(""), delta("c"), delta("d", finished=True)]

    async def written(*hand_offs) -> list[dict]:
        transport = Transport()
        _, stream, writer = _writer(transport)
        for deltas in hand_offs:
            hand_off(stream, *deltas)
        assert writer.done.done()
        return transport.messages

    async def main():
        one_by_one = await written(*([d] for d in steps))
        together = await written(steps[:2], steps[2:])
        assert [m["body"] for m in together] == [b"ab", b"cd|end"]
        assert b"".join(m["body"] for m in together) == b"".join(m["body"] for m in one_by_one) == b"abcd|end"
        assert [m["more_body"] for m in together] == [True, False]
        assert one_by_one[-1]["more_body"] is False and all(m["more_body"] for m in one_by_one[:-1])
        assert len(one_by_one) == 4  # the empty delta costs no write

    asyncio.run(main())


def test_a_slow_client_gets_the_steps_that_came_meanwhile_in_one_write():
    async def main():
        transport = Transport()
        owner, stream, writer = _writer(transport)
        transport.gate = asyncio.Event()
        hand_off(stream, delta("a"))  # suspends
        hand_off(stream, delta("b"))
        hand_off(stream, delta("c", finished=True))
        assert transport.messages == [] and not writer.done.done()
        transport.gate.set()
        await asyncio.wait_for(writer.done, 5)
        assert transport.bodies() == [b"a", b"bc|end"]
        assert transport.messages[-1]["more_body"] is False
        assert owner.aborted == []

    asyncio.run(main())


def test_a_failing_send_aborts_the_request_and_ends_the_writer():
    async def main():
        transport = Transport()
        owner, stream, writer = _writer(transport)
        transport.error = ConnectionResetError("gone")
        hand_off(stream, delta("a"))
        assert owner.aborted == ["r"] and writer.done.done()
        hand_off(stream, delta("b"))  # a step already on its way: dropped, not written
        assert transport.messages == []

    asyncio.run(main())


def test_deltas_and_errors_from_before_attach_are_delivered_on_attach():
    def before_attach(stream):
        stream._push(delta("a"))
        stream._fail(RuntimeError("engine died"))

    async def main():
        transport = Transport()
        _, _, writer = _writer(transport, before_attach=before_attach)
        assert transport.bodies() == [b"a", b"error:engine died"]
        assert writer.done.done()

    asyncio.run(main())


def test_a_render_error_ends_the_stream_with_the_error_bytes():
    def broken(d):
        raise ValueError("bad delta")

    async def main():
        transport = Transport()
        _, stream, _ = _writer(transport, render=broken)
        stream._push(delta("a"))  # the error event is written at once, not at the flush
        assert transport.messages[-1] == {"type": "http.response.body", "body": b"error:bad delta", "more_body": False}

    asyncio.run(main())


def test_the_response_sends_headers_then_the_stream_and_aborts_on_disconnect():
    async def main():
        transport = Transport()
        loop = asyncio.get_running_loop()
        owner = Owner()
        stream = RequestStream("r", owner._abort, loop)
        disconnected = asyncio.Event()

        async def receive():
            await disconnected.wait()
            return {"type": "http.disconnect"}

        response = EngineSSEResponse(stream, render, render_error, headers={"Cache-Control": "no-cache"})
        call = asyncio.ensure_future(response({"type": "http"}, receive, transport.send))
        # the headers are sent, and the writer attached to the stream in the same step
        await async_wait_until(lambda: transport.messages, timeout=5, message="the response started")
        hand_off(stream, delta("a"))
        start = transport.messages[0]
        assert start["type"] == "http.response.start" and start["status"] == 200
        headers = dict(start["headers"])
        assert headers[b"content-type"].startswith(b"text/event-stream") and b"content-length" not in headers
        assert transport.bodies() == [b"a"]
        disconnected.set()
        await asyncio.wait_for(call, 5)
        assert owner.aborted == ["r"]

    asyncio.run(main())
