"""The Router replica's lean HTTP server (roseray.ray_serve.router_server) against real sockets, with
requests exactly as HAProxy's Lua writes them (HTTP/1.0, Connection: close, read to EOF); and in a
real local Ray, that it has taken the Router replica's port over from Serve's server."""

import asyncio
import json

import pytest

from roseray.ray_serve import router_server, wiring
from roseray.ray_serve.ticket import TICKET_HEADER, TicketSigner
from tests.ray_serve.helpers import PICK, SECRET, endpoint, router_ports
from tests.waiting import async_wait_until


def lua_request(body: bytes, request_id: str | None = "abc", extra: str = "") -> bytes:
    """POST /internal/route as ingress_request_router.lua.tmpl writes it."""
    rid = f"x-request-id: {request_id}\r\n" if request_id is not None else ""
    return (f"POST /internal/route HTTP/1.0\r\nHost: 127.0.0.1:30001\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}{rid}\r\n").encode() + body


async def exchange(port: int, data: bytes, *, half_close: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    if half_close:
        writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


def parse(answer: bytes) -> tuple[int, dict, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1.1 "), lines[0]
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    assert int(headers[b"content-length"]) == len(body) and headers[b"connection"] == b"close"
    return int(lines[0].split()[1]), headers, body


def run_with_server(scenario, *, calls=None, error=None, max_body=1024):
    """Run `scenario(port)` against a RouteProtocol server on a loopback socket."""

    app = endpoint(calls, error)

    async def main():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: router_server.RouteProtocol(app, max_body), "127.0.0.1", 0)
        try:
            return await scenario(server.sockets[0].getsockname()[1])
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(main())


def test_answers_haproxys_lua_request_with_the_pick_and_a_ticket():
    calls = []
    body = b'{"prompt": [496], "max_tokens": 2}'
    request = lua_request(body, extra="X-Body-Truncated: 34/99\r\nx-session-id: sess\r\n")

    async def scenario(port):  # the request split over several writes, then the same again
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(0, len(request), 7):
            writer.write(request[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0)  # each piece its own write: the split request is the behaviour under test
        first = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return first, await exchange(port, lua_request(b"", "req-2"))

    first, second = run_with_server(scenario, calls=calls)
    status, headers, answer = parse(first)
    assert status == 200 and headers[b"content-type"] == b"application/json" and headers[b"x-roseray-router"] == b"lean"
    answer = json.loads(answer)
    ticket = answer[wiring.HEADERS_FIELD][TICKET_HEADER]
    assert answer == wiring.route_answer(PICK, {TICKET_HEADER: ticket})
    assert TicketSigner(SECRET).verify(ticket, "abc") is None
    assert calls == [(body, "sess", "34/99"), (b"", None, None)]
    second_ticket = json.loads(parse(second)[2])[wiring.HEADERS_FIELD][TICKET_HEADER]
    assert TicketSigner(SECRET).verify(second_ticket, "req-2") is None


def test_400_without_request_id_and_503_when_no_replica():
    calls = []
    missing = run_with_server(lambda port: exchange(port, lua_request(b"{}", None)), calls=calls)
    assert parse(missing)[::2] == (400, b'{"detail":"missing x-request-id"}') and calls == []
    unavailable = run_with_server(lambda port: exchange(port, lua_request(b"{}")),
                                  error=RuntimeError("replica r has no HTTP port yet"))
    assert parse(unavailable)[::2] == (503, b'{"detail":"replica r has no HTTP port yet"}')
    bug = run_with_server(lambda port: exchange(port, lua_request(b"{}")), error=ValueError("bug"))
    assert parse(bug)[0] == 500


def test_health_checks_and_unknown_paths():
    async def scenario(port):
        return [parse(await exchange(port, f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode()))
                for path in ("/-/healthz", "/health", "/nope?x=1", wiring.ROUTE_PATH)]

    healthz, health, unknown, wrong_method = run_with_server(scenario)
    assert (healthz[0], healthz[1][b"content-type"], healthz[2]) == (200, b"text/plain; charset=utf-8", b"success")
    assert (health[0], json.loads(health[2])) == (200, {"status": "ok"})
    assert unknown[0] == 404 and wrong_method[0] == 405


def test_health_check_follows_the_replicas_state():
    async def draining():
        return False, "DRAINING"

    app = endpoint()
    app.health = draining
    assert asyncio.run(app.respond("GET", wiring.HEALTHZ_PATH, [], b"")) == (503, b"DRAINING")



def test_refuses_oversized_heads_bodies_and_bad_requests():
    async def scenario(port):
        huge_head = b"GET /health HTTP/1.0\r\nx-pad: " + b"a" * (router_server.MAX_HEAD_BYTES + 10)  # no end yet
        return [parse(await exchange(port, data)) for data in (
            huge_head,
            lua_request(b"x" * 2000),  # over max_body=1024
            b"POST /internal/route HTTP/1.0\r\nContent-Length: nope\r\n\r\n",
            b"POST /internal/route HTTP/1.1\r\nTransfer-Encoding: chunked\r\nx-request-id: a\r\n\r\n0\r\n\r\n",
            b"garbage\r\n\r\n",
        )]

    statuses = [status for status, _, _ in run_with_server(scenario)]
    assert statuses == [400, 413, 400, 400, 400]


def test_clients_that_go_away_early_do_not_break_the_server():
    async def scenario(port):
        for partial in (b"POST /internal/ro", lua_request(b'{"prompt": "abc"}')[:-5], b""):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(partial)
            await writer.drain()
            writer.close()  # gone before the request is whole
            await writer.wait_closed()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(lua_request(b"{}"))
        writer.transport.abort()  # gone before the answer
        # a client that half-closes after its whole request still gets the answer
        return await exchange(port, lua_request(b"{}"), half_close=True)

    assert parse(run_with_server(scenario))[0] == 200


def test_parse_head():
    method, path, headers, length = router_server.parse_head(
        b"POST /internal/route?a=b HTTP/1.0\r\nHost: x\r\nX-Request-Id:  r1 \r\nContent-Length: 12")
    assert (method, path, length) == ("POST", "/internal/route", 12)
    assert headers == [(b"host", b"x"), (b"x-request-id", b"r1"), (b"content-length", b"12")]
    for bad in (b"GET /", b"GET / HTTP/2", b"GET / HTTP/1.0\r\nno colon", b"GET / HTTP/1.0\r\nA: 1\r\n bad: 2",
                b"GET / HTTP/1.0\r\nContent-Length: 1\r\nContent-Length: 2"):
        with pytest.raises(ValueError):
            router_server.parse_head(bad)


def test_router_replicas_port_is_answered_by_the_lean_server(ray_serve_cluster):
    """In a real local Ray: the Router replica's own port (the controller's ingress_request_router
    targets, as HAProxy's Lua lists them) answers HAProxy's request from the lean server, not Serve's uvicorn."""
    routers = router_ports(ray_serve_cluster.state_dir)
    assert routers, "no Router replica in HAProxy's Lua"
    for port in routers:
        status, headers, body = parse(asyncio.run(_eventually_lean(port)))
        assert status == 200 and headers[b"x-roseray-router"] == b"lean"
        assert (json.loads(body)["port"],) in {(p,) for _, p in ray_serve_cluster.engines()}
        healthz = parse(asyncio.run(exchange(port, b"GET /-/healthz HTTP/1.0\r\n\r\n")))
        assert healthz[::2] == (200, b"success") and b"x-roseray-router" in healthz[1]


async def _eventually_lean(port: int, timeout_s: float = 30.0) -> bytes:
    """The first answer from the lean server (the take-over follows the replica's start by a moment)."""
    async def lean_answer() -> bytes | None:
        answer = await exchange(port, lua_request(b'{"prompt": [496], "max_tokens": 2}'))
        return answer if b"x-roseray-router: lean" in answer.partition(b"\r\n\r\n")[0].lower() else None

    return await async_wait_until(lean_answer, timeout_s, interval=0.2, message=f"the lean server on port {port}")


@pytest.mark.parametrize("closable", [True, False])
def test_takes_a_servers_port_over_or_leaves_it_serving(monkeypatch, caplog, closable):
    """LeanRouterServer without Ray: another asyncio server of this process listens on the
    port (as Serve's does in the replica); the lean server takes it over, or, when that server
    cannot be closed, leaves it answering alone (and says so)."""

    async def main():
        async def old_server(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nold")
            writer.close()

        async def healthy():
            return True, "success"

        old = await asyncio.start_server(old_server, "127.0.0.1", 0)
        port = old.sockets[0].getsockname()[1]
        monkeypatch.setattr(wiring, "own_http_port", lambda app_name, router=False: port)
        monkeypatch.setattr(wiring, "serve_replica_health", lambda: healthy)
        if not closable:
            monkeypatch.setattr(wiring, "close_serve_listener", lambda port: False)
        lean = router_server.LeanRouterServer(endpoint(), "roseray")
        lean.start()
        await asyncio.to_thread(lean._thread.join, 10)
        answers = [parse(await exchange(port, b"GET /-/healthz HTTP/1.0\r\n\r\n")) for _ in range(3)]
        lean.stop()
        old.close()
        return lean, answers

    lean, answers = asyncio.run(main())
    if closable:
        assert lean.server is not None and lean.port is not None
        assert all(body == b"success" and headers[b"x-roseray-router"] == b"lean" for _, headers, body in answers)
    else:
        assert lean.server is None and all(body == b"old" for _, _, body in answers)
        assert "did not start" in caplog.text


def test_private_serve_hooks_that_router_server_reads():
    """What router_server and wiring's additions read from Ray 2.60 (tests/test_serve_wiring.py's role)."""
    import inspect

    from ray.serve._private.replica import Replica
    from ray.serve.schema import TargetGroup

    assert inspect.iscoroutinefunction(Replica._dataplane_health_check)
    assert "ingress_request_router_targets" in TargetGroup.model_fields
    assert isinstance(wiring.ROUTER_BUFSIZE, int) and router_server.default_max_body() > wiring.ROUTER_BUFSIZE
