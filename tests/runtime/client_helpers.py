"""Driving an EngineClient without an event loop (what AsyncLLMEngine does on its loop)."""

import select
import time

from roseray.runtime.engine_client import EngineClient


def wait_outputs(client: EngineClient, timeout_s: float = 10.0) -> list:
    """Send the held adds, wait until outputs come (or `timeout_s` passes), read them."""
    client.flush_commands()
    select.select([client.outputs_fd], [], [], timeout_s)
    return client.read_outputs()


def run_to_end(client: EngineClient, timeout_s: float = 60.0) -> list:
    """Every delta until the client has no unfinished request."""
    deltas, deadline = [], time.monotonic() + timeout_s
    while client.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish its requests"
        deltas += wait_outputs(client, 1.0)
    return deltas


def check_integrity(client: EngineClient, timeout_s: float = 30.0) -> list:
    """The engine's accounting check (AssertionError if it fails); returns the deltas read meanwhile."""
    call_id, deltas, deadline = client.send_integrity_check(), [], time.monotonic() + timeout_s
    while not client.integrity_replied(call_id):
        assert time.monotonic() < deadline, "no integrity reply"
        deltas += wait_outputs(client, 1.0)
    client.take_integrity_reply(call_id)
    return deltas
