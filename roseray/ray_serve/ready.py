"""The log line that says the app serves, printed once per node by one of its Router replicas:

    roseray ready at http://HOST:PORT (model M, N replicas, KV capacity K tokens)

"Ready" is tested, not assumed: completions through this node's HAProxy must come back from
an engine replica with the Router's ticket, which takes HAProxy, the app's routes, a Router
(HAProxy asks one for every POST) and an engine replica. The probe names a model nobody
serves, so it generates nothing: an engine that got it through the Router answers 404
model_not_found (401 when the app has an api_key), one that got it without the Router's
ticket (HAProxy before it knows the Router) 503 not_routed, and HAProxy itself 503s (see
haproxy_env's NOT_DEPLOYED and NOT_ROUTED) or refuses the connection before that. Two such
answers in a row count. N is the engine replicas HAProxy lists then; K is their KV cache in
tokens, all replicas together (one replica's `kv_total` routing stat times N: they share one
engine config).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Awaitable, Callable

from ray.serve.handle import DeploymentHandle

from roseray.ray_serve import wiring

# Serve's replica logger: its lines reach `serve run`'s terminal and the replica's log file
logger = logging.getLogger("ray.serve")

PROBE_PATH = "/v1/completions"
PROBE_BODY = json.dumps({"model": "roseray-ready-probe (no such model)", "prompt": "ready?", "max_tokens": 1})
PROBE_SUCCESSES = 2  # routed answers in a row
PROBE_PERIOD_S = 0.5
PROBE_TIMEOUT_S = 5.0


async def http_post(host: str, port: int, path: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[int, bytes]:
    """(status, body) of an HTTP/1.0 POST of PROBE_BODY; OSError / TimeoutError when no answer."""
    async def exchange() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"POST {path} HTTP/1.0\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(PROBE_BODY)}\r\n\r\n{PROBE_BODY}".encode())
            await writer.drain()
            return await reader.read()
        finally:
            writer.close()

    raw = await asyncio.wait_for(exchange(), timeout_s)
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        raise OSError(f"not an HTTP answer: {raw[:80]!r}") from None
    return status, body


def routed_to_an_engine(status: int, body: bytes) -> bool:
    """Whether a probe's answer came from an engine replica that got it through the Router (see
    the module docstring)."""
    if status not in (401, 404):
        return False
    try:
        return "error" in json.loads(body)
    except ValueError:
        return False


def ready_line(url: str, model: str, replicas: int, kv_tokens: int) -> str:
    return f"roseray ready at {url} (model {model}, {replicas} replicas, KV capacity {kv_tokens} tokens)"


def claim_once(marker_dir: str, key: str) -> bool:
    """True for the first caller with `key` in `marker_dir` (a file made with O_EXCL): the Router
    replicas of one node print the line once between them."""
    name = "roseray-ready-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    try:
        os.close(os.open(os.path.join(marker_dir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


class ReadyAnnouncement:
    """Probes until the app serves through this node's HAProxy, then logs `ready_line` once."""

    def __init__(self, engine: DeploymentHandle, app_name: str, build_key: str, model: str, block_size: int,
                 post: Callable[[str, int, str], Awaitable[tuple[int, bytes]]] = http_post) -> None:
        self.engine = engine
        self.app_name = app_name
        self.build_key = build_key  # differs per build of the app: a redeploy announces again
        self.model = model
        self.block_size = block_size
        self.post = post
        self.line: str | None = None

    async def run(self) -> str | None:
        """The line, once logged (None: another Router replica of this node logged it, or the
        announcement failed: a warning says why; serving goes on either way)."""
        try:
            return await self._announce()
        except Exception as error:  # noqa: BLE001 - a missing log line must not break the Router
            logger.warning("roseray: no ready line: %r", error)
            return None

    async def _announce(self) -> str | None:
        host, port, url = await asyncio.to_thread(wiring.local_http_address)
        successes = 0
        while successes < PROBE_SUCCESSES:
            try:
                routed = routed_to_an_engine(*await self.post(host, port, PROBE_PATH))
            except (OSError, TimeoutError):
                routed = False
            successes = successes + 1 if routed else 0
            await asyncio.sleep(PROBE_PERIOD_S)
        replicas = len(await asyncio.to_thread(wiring.engine_http_targets, self.app_name))
        while True:  # one replica's KV blocks from its routing stats (every replica has the same engine config)
            kv_blocks = (await wiring.replica_routing_stats(self.engine)).get("kv_total")
            if kv_blocks is not None:
                break
            await asyncio.sleep(PROBE_PERIOD_S)
        if not claim_once(wiring.session_dir(), f"{self.app_name}\0{self.build_key}"):
            return None
        self.line = ready_line(url, self.model, replicas, replicas * int(kv_blocks) * self.block_size)
        logger.info(self.line)
        return self.line
