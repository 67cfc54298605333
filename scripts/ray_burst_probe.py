"""Where a burst's time goes on the Ray Serve path: N streaming requests sent at once,
through HAProxy (the whole path), then each hop alone.

    python scripts/ray_burst_probe.py --port 8000 --ticket-secret S [-n 64] [--max-tokens 2]

Legs (each a burst of N sent together over connections opened beforehand, unless said):
  haproxy   POST /v1/completions (stream) to HAProxy's port: TTFT (first data event)
  route     POST /internal/route to the Router replicas' own ports, one new connection per
            request with `Connection: close`, round-robin over the Router replicas, as HAProxy's
            Lua does: time to the answer; `span` is the whole burst's (first send to last
            answer) and `per_decision` span / N, the Router's cost per decision when they queue
  engine    the same streams straight to the Engine replica's port with a ticket signed
            here (needs the app's ticket_secret): TTFT without HAProxy and the Router
  (--standalone-port P: the same streams to a `roseray serve` on P)
One client process opens and sends every request: at -n 128 it measures mostly itself (on the
H100 host even the route leg's fastest answer took 12 ms). For where a real burst's time goes,
use the request trace instead (`TRACE=1 bash scripts/ray_vs_inprocess.sh`, burst_timeline.py).
The app must be running (serve run ...). Ports of the Router and Engine replicas come from
the Serve controller (connects to the local Ray with ray.init(address="auto")).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

import numpy as np

BODY = {"prompt": [496], "temperature": 0.0, "ignore_eos": True, "stream": True}


def _pct(values: list[float]) -> dict:
    a = np.asarray(values) * 1000.0
    return {"n": len(a), "min": round(float(a.min()), 1), "p50": round(float(np.percentile(a, 50)), 1),
            "p90": round(float(np.percentile(a, 90)), 1), "p99": round(float(np.percentile(a, 99)), 1),
            "max": round(float(a.max()), 1)}


async def _stream(session, url: str, body: dict, headers: dict) -> float:
    sent = time.perf_counter()
    first = None
    async with session.post(url, json=body, headers=headers) as response:
        assert response.status == 200, (response.status, await response.text())
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter()
    return first - sent


async def stream_burst(url: str, n: int, max_tokens: int, make_headers, rounds: int) -> list[dict]:
    import aiohttp

    body = dict(BODY, max_tokens=max_tokens)
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*[_stream(session, url, dict(BODY, max_tokens=2), make_headers()) for _ in range(n)])
        for _ in range(rounds):
            await asyncio.sleep(0.5)
            ttft = await asyncio.gather(*[_stream(session, url, body, make_headers()) for _ in range(n)])
            out.append(_pct(ttft))
    return out


async def _route_once(host: str, port: int, body: bytes) -> float:
    sent = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    head = (f"POST /internal/route HTTP/1.0\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"x-request-id: {uuid.uuid4()}\r\n\r\n").encode()
    writer.write(head + body)
    data = await reader.read()
    writer.close()
    assert data.startswith(b"HTTP/1.1 200") or data.startswith(b"HTTP/1.0 200"), data[:200]
    return time.perf_counter() - sent


async def route_burst(routers: list[tuple[str, int]], n: int, max_tokens: int, rounds: int) -> list[dict]:
    body = json.dumps(dict(BODY, max_tokens=max_tokens)).encode()
    await asyncio.gather(*[_route_once(*routers[i % len(routers)], body) for i in range(8 * len(routers))])
    out = []
    for _ in range(rounds):
        await asyncio.sleep(0.5)
        start = time.perf_counter()
        latencies = await asyncio.gather(*[_route_once(*routers[i % len(routers)], body) for i in range(n)])
        span = time.perf_counter() - start
        out.append(dict(_pct(latencies), span=round(span * 1000.0, 1), per_decision=round(span * 1000.0 / n, 3)))
    return out


def targets(app: str = "roseray", address: str = "auto") -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    import ray
    from ray.serve._private import constants as c

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    controller = ray.get_actor(c.SERVE_CONTROLLER_NAME, namespace=c.SERVE_NAMESPACE)
    groups = ray.get(controller.get_target_groups.remote(app, True))
    engines, routers = set(), set()
    for g in groups:
        if g.app_name != app or str(getattr(g.protocol, "value", g.protocol)).upper() != "HTTP":
            continue
        engines |= {(t.ip, t.port) for t in g.targets}
        routers |= {(t.ip, t.port) for t in (g.ingress_request_router_targets or [])}
    ray.shutdown()
    return sorted(engines), sorted(routers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ticket-secret", default=None)
    parser.add_argument("--standalone-port", type=int, default=None)
    parser.add_argument("--legs", default="haproxy,route,engine")
    parser.add_argument("--replica-host", default="127.0.0.1",
                        help="where the replicas listen (http_options.host; '' for the node ip Serve reports)")
    parser.add_argument("--ray-address", default="auto",
                        help="the Ray cluster of the app (GCS host:port; 'auto': the latest one started here). With "
                             "token auth (Ray's default for a local cluster) set RAY_AUTH_MODE=token for an address")
    parser.add_argument("--out", default=None, help="write the percentiles (ms) as JSON here")
    args = parser.parse_args()
    legs = args.legs.split(",")
    result: dict = {"n": args.n, "max_tokens": args.max_tokens}
    if args.standalone_port:
        url = f"http://127.0.0.1:{args.standalone_port}/v1/completions"
        result["standalone"] = asyncio.run(stream_burst(url, args.n, args.max_tokens, dict, args.rounds))
        for stats in result["standalone"]:
            print(f"n={args.n} standalone " + " ".join(f"{k}={v}" for k, v in stats.items() if k != "n"))
        return
    engines, routers = targets(address=args.ray_address)
    result["engines"], result["routers"] = engines, routers
    if "haproxy" in legs:
        url = f"http://127.0.0.1:{args.port}/v1/completions"
        result["haproxy"] = asyncio.run(stream_burst(url, args.n, args.max_tokens, dict, args.rounds))
    if "route" in legs:
        hosts = [(args.replica_host or host, port) for host, port in routers]
        result["route"] = asyncio.run(route_burst(hosts, args.n, args.max_tokens, args.rounds))
    if "engine" in legs and args.ticket_secret:
        from roseray.serve.ticket import REQUEST_ID_HEADER, TICKET_HEADER, TicketSigner

        signer = TicketSigner(args.ticket_secret)

        def headers() -> dict:
            request_id = str(uuid.uuid4())
            return {REQUEST_ID_HEADER: request_id, TICKET_HEADER: signer.sign(request_id)}

        host, port = args.replica_host or engines[0][0], engines[0][1]
        url = f"http://{host}:{port}/v1/completions"
        result["engine"] = asyncio.run(stream_burst(url, args.n, args.max_tokens, headers, args.rounds))
    for leg in ("haproxy", "route", "engine"):
        for stats in result.get(leg, []):
            print(f"n={args.n} {leg:8s} " + " ".join(f"{k}={v}" for k, v in stats.items() if k != "n"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
