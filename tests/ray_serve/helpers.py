"""What the Ray Serve tests share: waiting until HAProxy routes requests through the Router."""

import httpx

from tests.waiting import wait_until


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
