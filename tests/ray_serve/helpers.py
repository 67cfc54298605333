"""What the Ray Serve tests share: waiting until HAProxy routes requests through the Router,
the Router replicas' ports, and a Router endpoint app (no Ray) that always picks one replica."""

import glob
import os
import re

import httpx

from roseray.ray_serve import wiring
from roseray.ray_serve.router_endpoint import RouterEndpoint
from roseray.ray_serve.ticket import TicketSigner
from tests.waiting import wait_until

SECRET = "s" * 32
PICK = wiring.ReplicaPick(host="10.0.0.7", port=30001, replica_id="roseray#Engine#abc")


def endpoint(calls=None, error=None) -> RouterEndpoint:
    """A RouterEndpoint whose pick records its arguments in `calls` and returns PICK (or raises `error`)."""

    async def pick(body, session_id, truncated):
        if calls is not None:
            calls.append((body, session_id, truncated))
        if error is not None:
            raise error
        return PICK

    return RouterEndpoint(pick, TicketSigner(SECRET))


def wait_for_routing(url: str, timeout_s: float = 60, headers: dict | None = None) -> None:
    """HAProxy learns the Router and the replicas a little after serve.run returns; until
    then it sends requests to replicas without a ticket (503) or fails them. Returns after
    six requests in a row succeeded."""
    successes, last = [0], [None]

    def routed() -> bool:
        try:
            response = httpx.post(url + "/v1/completions", json={"prompt": "warm", "max_tokens": 1}, timeout=10,
                                  headers=headers)
            successes[0] = successes[0] + 1 if response.status_code == 200 else 0
            last[0] = (response.status_code, dict(response.headers), response.text[:2000])
        except httpx.HTTPError as error:
            successes[0], last[0] = 0, repr(error)
        return successes[0] >= 6

    wait_until(routed, timeout=timeout_s, interval=0.05,
               message=lambda: f"HAProxy routed requests through the Router; last: {last[0]}")


def router_ports(state_dir: str, timeout_s: float = 60.0) -> set[int]:
    """The Router replicas' ports, from the Lua script Serve writes for HAProxy (the controller's
    ingress_request_router_targets; wiring._http_targets(app, routers=True) in a process connected to Ray),
    once HAProxy's config lists them."""
    def ports() -> set[int]:
        found = set()
        for path in glob.glob(os.path.join(state_dir, "**", "ingress_request_router.lua"), recursive=True):
            with open(path) as f:
                found |= {int(p) for p in re.findall(r"port = (\d+)", f.read())}
        return found

    return wait_until(ports, timeout_s, interval=0.2, message="a Router port in HAProxy's Lua")
