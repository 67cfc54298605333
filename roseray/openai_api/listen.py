"""The listening sockets of `roseray serve`, bound before the model loads: a port that another
process holds (or that this user may not bind) fails at once, with one line naming it and,
where Linux's /proc tells, the process that listens there."""

from __future__ import annotations

import errno
import os
import socket
import sys
from dataclasses import dataclass

LISTEN = "0A"  # a TCP socket's state in /proc/net/tcp: listening


class CannotListenError(RuntimeError):
    """host:port cannot be bound; the message names it and why."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet: the server listens once its app is up)."""
    family, kind, proto, address = _address(host, port)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _bind(sock, address, host, port)
    except BaseException:
        sock.close()
        raise
    return sock


def bind_reuseport_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to host:port in one SO_REUSEPORT group (not listening yet:
    each API process listens once it is ready). A first bind without SO_REUSEPORT makes
    sure no other server holds the port: it would otherwise join the group silently."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        raise RuntimeError("--api-processes > 1 needs Linux (SO_REUSEPORT spreads the connections); "
                           "use --api-processes 1 here")
    family, kind, proto, address = _address(host, port)
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _bind(probe, address, host, port)  # fails if another server listens there
        address = probe.getsockname()  # with port 0: the port the kernel picked
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            _bind(sock, address, host, port)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _address(host: str, port: int) -> tuple[int, int, int, tuple]:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise CannotListenError(f"cannot listen on {host}:{port}: {error.strerror}") from error
    return family, kind, proto, address


def _bind(sock: socket.socket, address: tuple, host: str, port: int) -> None:
    try:
        sock.bind(address)
    except OSError as error:
        holder = port_holder(port) if error.errno == errno.EADDRINUSE else None
        who = f"{holder} listens there" if holder else "another process listens there"
        why = {errno.EADDRINUSE: f"{who} (stop it, or pick another --port)",
               errno.EACCES: "not allowed for this user (ports below 1024 need privileges)",
               errno.EADDRNOTAVAIL: "this machine has no such address"}.get(error.errno, error.strerror)
        raise CannotListenError(f"cannot listen on {host}:{port}: {why}") from error


@dataclass(frozen=True)
class PortHolder:
    """A process that listens on a TCP port."""

    pid: int
    name: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name})"


def port_holder(port: int) -> PortHolder | None:
    """A process that listens on TCP `port`, from /proc (Linux; only processes whose
    descriptors this user may read), or None when it cannot tell."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rpartition(":")[2], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in filter(str.isdigit, _listdir("/proc")):
        for fd in _listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return PortHolder(int(pid), _command(pid))
            except OSError:
                continue
    return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"
