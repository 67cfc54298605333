"""A Serve replica's own HTTP port, for the roseray servers that take it over from Serve's.

Serve binds a replica's port after the constructor returns, on a port the controller
allocates, and lists it for HAProxy once the replica runs. An Engine replica hands that
listening socket to its API processes (replica_api_processes.py); a Router replica serves
it with its lean /internal/route server (router_server.py). Both wait here, in a thread,
until the controller lists the port, then find the socket among this process's file
descriptors.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

POLL_S = 0.1  # how often to ask the controller whether the port is listed yet
TIMEOUT_S = 300.0


def wait_until_listed(lookup: Callable[[], int | None], stopping: Callable[[], bool],
                      timeout_s: float = TIMEOUT_S) -> int | None:
    """The port `lookup()` returns (wiring.own_http_port) once the
    controller lists it; None if `stopping()` first. Raises after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (port := lookup()) is None:
        if stopping():
            return None
        if time.monotonic() > deadline:
            raise RuntimeError(f"the controller did not list this replica's port within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return port


def listening_socket_fd(port: int) -> int:
    """The file descriptor of this process's TCP socket listening on `port` (Linux /proc)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with probe:
            try:
                listening = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                address = probe.getsockname()
            except OSError:
                continue
            if (listening and probe.type == socket.SOCK_STREAM and probe.family in (socket.AF_INET, socket.AF_INET6)
                    and address[1] == port):
                return fd
    raise RuntimeError(f"no socket of this process listens on port {port}")
