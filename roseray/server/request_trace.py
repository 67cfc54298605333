"""Per-request timeline events, to see where a burst's time goes across processes (off by default).

With `ROSERAY_REQUEST_TRACE_DIR` set in their environment (for the Ray app: when Ray starts),
the processes a request passes through record `(x-request-id, event, time.monotonic())`:

    client_sent          the load generator put the request on the wire (scripts/http_vs_inprocess.py)
    router_accepted      a Router replica accepted HAProxy's /internal/route connection for it
    router_answered      ... and answered it
    api_received         an API process's ASGI app got the request (fast path, body not read yet)
    admitted             the API process stamped its arrival and hands it to the engine
    client_first_token   the load generator read its first token

One monotonic clock serves every process of a host, so the times compare across processes
of one machine. Each process keeps its events in memory and appends them to
`<dir>/<name>-<pid>.jsonl` once it has been idle for `IDLE_S` (between a benchmark's
bursts), so writing never lands inside a burst. Only request ids are recorded: no prompt
text. `scripts/burst_timeline.py DIR` merges a directory into a table per event and leg.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "ROSERAY_REQUEST_TRACE_DIR"
IDLE_S = 0.3  # written when nothing was recorded for this long
POLL_S = 0.05
REQUEST_ID_HEADER = b"x-request-id"


class RequestTrace:
    """Events of this process, written to `directory` by a daemon thread when idle."""

    def __init__(self, directory: str, name: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{name}-{os.getpid()}.jsonl")
        self._events: list[tuple[str, str, float]] = []  # recorded and not written yet
        self._last = 0.0
        self._lock = threading.Lock()  # record() against the writer taking the list
        threading.Thread(target=self._write_when_idle, name="roseray-request-trace", daemon=True).start()

    def record(self, request_id: str, event: str, at: float | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((request_id, event, now if at is None else at))
            self._last = now

    def flush(self) -> None:
        with self._lock:
            new, self._events = self._events, []
        if new:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(event) + "\n" for event in new)

    def _write_when_idle(self) -> None:
        while True:
            time.sleep(POLL_S)
            if self._events and time.monotonic() - self._last > IDLE_S:
                self.flush()


_traces: dict[str, RequestTrace] = {}


def from_env(name: str) -> RequestTrace | None:
    """This process's trace for `name` (one per name and process), or None when tracing is off."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    trace = _traces.get(name)
    if trace is None:
        trace = _traces[name] = RequestTrace(directory, name)
    return trace


def header_request_id(headers) -> str:
    """The x-request-id of ASGI-style (lower-case name, value) byte pairs ('' when absent)."""
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            return value.decode("latin-1")
    return ""
