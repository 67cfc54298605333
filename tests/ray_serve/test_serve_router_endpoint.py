"""The Router replica's HTTP app (roseray.ray_serve.router_endpoint, no Ray cluster): what HAProxy's
Lua gets from POST /internal/route (the replica, a valid ticket for the request id; 400 without
an id, 503 when no replica can be picked), /health, and the hint the Router deployment's `pick`
builds from the body, the session id and X-Body-Truncated."""

import asyncio
import json
import socket
import types

import pytest
import uvicorn

from roseray.ray_serve import app as serve_app
from roseray.ray_serve import router_endpoint, wiring
from roseray.ray_serve.router_endpoint import RouterEndpoint
from roseray.ray_serve.router_metrics import RouterMetrics
from roseray.ray_serve.routing import HintConfig, RoutingHint, hint_from_body
from roseray.ray_serve.ticket import TICKET_HEADER, TicketSigner
from tests.ray_serve.helpers import PICK, SECRET, endpoint
from tests.waiting import async_wait_until


def call(app, method, path, headers=(), chunks=(b"",)):
    """(status, headers, JSON body) of one ASGI HTTP request whose body arrives in `chunks`."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    asyncio.run(app(scope, receive, send))
    start, body = sent
    assert start["type"] == "http.response.start" and body["type"] == "http.response.body"
    response_headers = dict(start["headers"])
    assert int(response_headers[b"content-length"]) == len(body["body"])
    return start["status"], response_headers, json.loads(body["body"])


def test_route_answers_the_picked_replica_with_a_ticket_for_the_request_id():
    calls = []
    app = endpoint(calls)
    status, headers, answer = call(app, "POST", wiring.ROUTE_PATH,
                                   [("X-Request-Id", "req-1"), ("x-session-id", "sess"), ("X-Body-Truncated", "10/99")],
                                   chunks=(b'{"prompt": "ab', b'c"}'))
    assert status == 200 and headers[b"content-type"] == b"application/json"
    ticket = answer[wiring.HEADERS_FIELD][TICKET_HEADER]
    assert answer == wiring.route_answer(PICK, {TICKET_HEADER: ticket})  # the shape HAProxy's Lua reads
    signer = TicketSigner(SECRET)
    assert signer.verify(ticket, "req-1") is None and signer.verify(ticket, "req-2") is not None
    assert calls == [(b'{"prompt": "abc"}', "sess", "10/99")]  # the whole body, both headers
    # a second answer for the same replica (its frame cached) carries its own ticket
    _, _, again = call(app, "POST", wiring.ROUTE_PATH, [("x-request-id", "req-2")])
    assert signer.verify(again[wiring.HEADERS_FIELD][TICKET_HEADER], "req-2") is None
    assert calls[1] == (b"", None, None)


def test_route_without_request_id_is_400_and_never_picks():
    calls = []
    for headers in ([], [("x-request-id", "")]):
        assert call(endpoint(calls), "POST", wiring.ROUTE_PATH, headers) == (
            400, {b"content-type": b"application/json", b"content-length": b"33"},
            {"detail": "missing x-request-id"})
    assert calls == []


def test_route_answers_503_when_no_replica_can_be_picked():
    status, _, answer = call(endpoint(error=RuntimeError("replica r has no HTTP port yet")), "POST",
                             wiring.ROUTE_PATH, [("x-request-id", "r")])
    assert (status, answer) == (503, {"detail": "replica r has no HTTP port yet"})


def test_other_errors_are_not_swallowed():
    with pytest.raises(ValueError):
        call(endpoint(error=ValueError("bug")), "POST", wiring.ROUTE_PATH, [("x-request-id", "r")])


def test_health_and_unknown_paths():
    app = endpoint()
    assert call(app, "GET", "/health")[::2] == (200, {"status": "ok"})
    assert call(app, "GET", "/nope")[0] == 404
    assert call(app, "GET", wiring.ROUTE_PATH)[0] == 405
    assert call(app, "POST", "/health")[0] == 405


def test_metrics_are_the_routers_prometheus_exposition_when_given():
    metrics = RouterMetrics("tiny")
    metrics.observe_view_age(0.4)
    app = RouterEndpoint(endpoint().pick, TicketSigner(SECRET), metrics)
    status, body = asyncio.run(app.respond("GET", "/metrics", [], b""))
    assert status == 200 and router_endpoint.content_type("/metrics").startswith(b"text/plain; version=0.0.4")
    assert b'roseray:router_kv_view_age_seconds_bucket{le="0.4",model_name="tiny"} 1.0' in body
    assert asyncio.run(app.respond("POST", "/metrics", [], b""))[0] == 405
    assert call(endpoint(), "GET", "/metrics")[0] == 404  # none given


def test_lifespan_completes():
    app, sent = endpoint(), []
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message["type"])

    asyncio.run(app({"type": "lifespan"}, receive, send))
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_answers_an_http_1_0_connection_close_request_like_haproxys_lua():
    """Through a real uvicorn (what Serve runs on the Router replica's port): the request exactly as
    the Lua writes it, read until the server closes the connection."""

    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(endpoint(), log_level="error", lifespan="on"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        await async_wait_until(lambda: server.started, message="uvicorn started")
        body = b'{"prompt": [496], "max_tokens": 2}'
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /internal/route HTTP/1.0\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\nx-request-id: abc\r\n\r\n" % len(body) + body)
        response = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        server.should_exit = True
        await task
        return response

    head, _, body = asyncio.run(main()).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    answer = json.loads(body)
    assert (answer["host"], answer["port"], answer["replica_id"]) == (PICK.host, PICK.port, PICK.replica_id)
    assert TicketSigner(SECRET).verify(answer[wiring.HEADERS_FIELD][TICKET_HEADER], "abc") is None


def _router(policy):
    """A RouterDeployment's state without Serve: what its `pick` reads."""
    return types.SimpleNamespace(engine="handle", policy=policy, chainer=None,
                                 hint_config=HintConfig(block_size=16, chars_per_token=1.0))


def test_pick_builds_the_hint_from_body_session_and_truncation(monkeypatch):
    seen = []

    async def pick_replica(handle, *route_args, reserve=False):
        seen.append((handle, route_args, reserve))
        return PICK

    monkeypatch.setattr(wiring, "pick_replica", pick_replica)
    pick = serve_app.RouterDeployment.func_or_class.pick
    router = _router("kv_queue")
    body = json.dumps({"prompt": "x" * 600, "max_tokens": 10}).encode()
    assert asyncio.run(pick(router, body, None, f"{len(body)}/{4 * len(body)}")) == PICK
    (handle, (hint,), reserve), = seen
    assert handle == "handle" and reserve is False
    assert hint == hint_from_body(body, None, router.hint_config, f"{len(body)}/{4 * len(body)}")
    assert isinstance(hint, RoutingHint)
    assert hint.need_blocks > hint_from_body(body, None, router.hint_config).need_blocks
    seen.clear()
    asyncio.run(pick(router, b"", "sess-1", None))
    assert seen[0][1][0].prefix_hashes == hint_from_body(b"", "sess-1", router.hint_config).prefix_hashes != ()


def test_power_of_two_picks_through_serves_reservation(monkeypatch):
    seen = []

    async def pick_replica(handle, *route_args, reserve=False):
        seen.append((route_args, reserve))
        return PICK

    monkeypatch.setattr(wiring, "pick_replica", pick_replica)
    pick = serve_app.RouterDeployment.func_or_class.pick
    assert asyncio.run(pick(_router("power_of_two"), b"{}", None, None)) == PICK
    assert seen == [((), True)]


def test_router_replicas_come_from_the_env_ray_reads_and_the_config_must_agree(tmp_path, monkeypatch):
    """Ray 2.60 runs RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE Router replicas per proxy node and
    ignores the deployment's num_replicas: haproxy_env exports the count, router.num_replicas
    is auto (that count) or must say the same (a config that asks for 4 and gets 1 is refused)."""
    from roseray.ray_serve import haproxy_env
    from roseray.ray_serve.app import RouterArgs

    name = haproxy_env.ROUTER_REPLICAS_ENV
    hap = str(tmp_path / "hap")
    assert name not in haproxy_env.haproxy_env(hap, router_replicas_per_node=1)  # Ray's default
    assert haproxy_env.haproxy_env(hap, router_replicas_per_node=4)[name] == "4"
    monkeypatch.delenv(name, raising=False)
    assert RouterArgs().num_replicas == "auto" and RouterArgs().replicas() == 1
    assert RouterArgs(num_replicas=1).replicas() == 1
    with pytest.raises(ValueError, match="--router-replicas-per-node 4"):
        RouterArgs(num_replicas=4)
    monkeypatch.setenv(name, "4")
    assert RouterArgs().replicas() == 4
    assert RouterArgs(num_replicas=4).replicas() == 4
    with pytest.raises(ValueError, match="RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE=4"):
        RouterArgs(num_replicas=1)


@pytest.mark.parametrize("visible, dev_files, gpus", [
    (None, ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"], 2),  # the device files, not the control ones
    (None, [], 0),
    ("0,1,2", [], 3),
    ("", ["nvidia0"], 0),  # hidden from CUDA
    ("-1", ["nvidia0"], 0),
    ("0,-1,1", [], 1),  # CUDA stops at the first invalid entry
    ("GPU-5f2c", [], 1),  # a UUID
])
def test_haproxy_env_auto_picks_four_routers_on_a_gpu_node(tmp_path, monkeypatch, visible, dev_files, gpus):
    from roseray.ray_serve import haproxy_env

    dev = tmp_path / "dev"
    dev.mkdir()
    for name in dev_files:
        (dev / name).touch()
    real_glob = haproxy_env.glob.glob
    monkeypatch.setattr(haproxy_env.glob, "glob",
                        lambda pattern: real_glob(pattern.replace("/dev/", f"{dev}/")))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert haproxy_env.local_gpu_count() == gpus
    expected = haproxy_env.GPU_ROUTER_REPLICAS if gpus else 1
    assert haproxy_env.auto_router_replicas() == expected
    env = haproxy_env.haproxy_env(str(tmp_path / "hap"))  # the default is auto
    assert env.get(haproxy_env.ROUTER_REPLICAS_ENV, "1") == str(expected)


def test_haproxy_env_cli_takes_auto_or_a_count(tmp_path, monkeypatch, capsys):
    from roseray.ray_serve import haproxy_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert haproxy_env.main(["--dir", str(tmp_path / "a")]) == 0
    assert f"export {haproxy_env.ROUTER_REPLICAS_ENV}=4" in capsys.readouterr().out
    assert haproxy_env.main(["--dir", str(tmp_path / "b"), "--router-replicas-per-node", "1"]) == 0
    assert haproxy_env.ROUTER_REPLICAS_ENV not in capsys.readouterr().out
    for bad in ("0", "two", "-3"):
        with pytest.raises(SystemExit):
            haproxy_env.main(["--dir", str(tmp_path / "c"), "--router-replicas-per-node", bad])
