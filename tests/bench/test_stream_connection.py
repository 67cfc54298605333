"""roseray.bench.stream_connection: the load generator's keep-alive HTTP/1.1 connection,
against a raw server that frames its answers by hand and splits them anywhere."""

from __future__ import annotations

import asyncio
import json

import pytest

from roseray.bench.stream_connection import StreamConnection, encode_post

EVENTS = [b'data: {"id":"a","choices":[{"text":"x"}]}\n\n', b'data: {"id":"a","choices":[{"text":"y"}]}\n\n',
          b'data: {"id":"a","choices":[{"text":"z"}]}\n\n',
          b'data: {"id":"a","choices":[],"usage":{"completion_tokens":3}}\n\n', b"data: [DONE]\n\n"]


def chunked(pieces: list[bytes], extension: bool = False) -> bytes:
    """`pieces` in chunked framing (with a chunk extension on each size line if asked)."""
    ext = b";name=value" if extension else b""
    return b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces) + b"0\r\n\r\n"


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
               b"x-roseray-replica: r/api2\r\n\r\n")


async def _serve(answers: list[list[bytes]], close_after: bool = False):
    """A server whose n-th request on a connection gets answers[n], written piece by piece
    with a pause between pieces (each a separate read on the client); returns the server and
    the requests it read."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for pieces in answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                seen.append(head + await reader.readexactly(length))
                pause = 0.01 if len(pieces) < 20 else 0.0005  # byte by byte: shorter pauses
                for piece in pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(pause)  # the pieces arrive as separate reads: the behaviour under test
            if close_after:
                writer.close()
            else:
                await reader.read()  # until the client closes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(data))), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("cuts", [
    [],  # the whole answer in one read
    "bytes",  # one byte per read: every frame and event cut everywhere
    [len(STREAM_HEAD) - 2, len(STREAM_HEAD) + 3, len(STREAM_HEAD) + 60],  # the head, a size line, an event
])
def test_a_streamed_answer_is_dechunked_and_each_event_counted_once_however_it_is_split(cuts):
    body = chunked([EVENTS[0] + EVENTS[1][:20], EVENTS[1][20:], EVENTS[2], EVENTS[3] + EVENTS[4]], extension=True)
    answer_bytes = STREAM_HEAD + body
    if cuts == "bytes":
        cuts = list(range(1, len(answer_bytes)))

    async def run():
        server, port, seen = await _serve([_split(answer_bytes, cuts)] * 2)
        async with server:
            connection = await StreamConnection.open("127.0.0.1", port)
            request = encode_post("127.0.0.1", port, "/v1/completions", {"prompt": [1], "stream": True})
            answers = [await connection.request(request) for _ in range(2)]  # keep-alive: the same connection
            connection.close()
        return answers, seen, request

    answers, seen, request = asyncio.run(run())
    assert seen == [request, request]
    for answer in answers:
        assert answer.status == 200 and answer.headers["x-roseray-replica"] == "r/api2"
        assert answer.completion_tokens == 3 and len(answer.event_times) == 3
        assert answer.event_times == sorted(answer.event_times)


def test_the_request_is_a_keep_alive_post_with_the_body_as_json():
    request = encode_post("127.0.0.1", 8000, "/v1/completions", {"a": [1, 2]}, {"Authorization": "Bearer k"})
    head, body = request.split(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/completions HTTP/1.1" and "Host: 127.0.0.1:8000" in lines
    assert f"Content-Length: {len(body)}" in lines and "Authorization: Bearer k" in lines
    assert json.loads(body) == {"a": [1, 2]}


def test_an_error_answer_keeps_its_body_and_the_connection_serves_the_next_request():
    error = b'{"error":{"message":"queue full","type":"rate_limit_error","param":null,"code":429}}'
    refusal = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error)

    async def run():
        server, port, _ = await _serve([[refusal[:30], refusal[30:]], [STREAM_HEAD + chunked(EVENTS)]])
        async with server:
            connection = await StreamConnection.open("127.0.0.1", port)
            request = encode_post("127.0.0.1", port, "/", {})
            first, second = await connection.request(request), await connection.request(request)
            connection.close()
        return first, second

    first, second = asyncio.run(run())
    assert first.status == 429 and first.headers["retry-after"] == "1" and first.body == error
    assert first.event_times == [] and first.completion_tokens is None
    assert second.status == 200 and len(second.event_times) == 3


def test_connection_close_ends_the_connection_and_a_cut_answer_raises():
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(EVENTS)
    cut = STREAM_HEAD + chunked(EVENTS)[:40]

    async def run():
        server, port, _ = await _serve([[closing]])
        async with server:
            connection = await StreamConnection.open("127.0.0.1", port)
            request = encode_post("127.0.0.1", port, "/", {})
            answer = await connection.request(request)
            with pytest.raises(ConnectionError):
                connection.request(request)
        server, port, _ = await _serve([[cut]], close_after=True)
        async with server:
            connection = await StreamConnection.open("127.0.0.1", port)
            with pytest.raises(ConnectionError, match="mid-answer"):
                await connection.request(encode_post("127.0.0.1", port, "/", {}))
        return answer

    answer = asyncio.run(run())
    assert answer.status == 200 and answer.completion_tokens == 3


def test_a_malformed_answer_fails_its_request_and_closes_the_connection():
    async def run():
        server, port, _ = await _serve([[b"SSH-2.0-OpenSSH\r\n\r\n"]])
        async with server:
            connection = await StreamConnection.open("127.0.0.1", port)
            with pytest.raises(ValueError, match="not an HTTP"):
                await connection.request(encode_post("127.0.0.1", port, "/", {}))
            assert connection.closed

    asyncio.run(run())
