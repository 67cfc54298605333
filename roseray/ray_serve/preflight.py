"""Checks before Ray starts: is the serving port of a Serve config free?

    python -m roseray.ray_serve.preflight serve_config.yaml    # exit 0, or one line and exit 1

`serve run` finds a taken port only after Ray and Serve are up, when HAProxy fails to bind
and Serve retries it with a traceback each time. This check binds the port of
`http_options` first, the way HAProxy will (SO_REUSEADDR, so that connections of an
earlier server in TIME_WAIT do not count), and names the process that listens there when
/proc tells (Linux, and only for processes of this user or with the privilege to look).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys

import yaml

from roseray.openai_api.listen import port_holder

DEFAULT_HOST = "127.0.0.1"  # Serve's default http_options.host
DEFAULT_PORT = 8000  # Serve's default http_options.port


def serving_address(config_path: str) -> tuple[str, int]:
    """(host, port) of a Serve config's http_options, with Serve's defaults."""
    with open(config_path) as f:
        config = yaml.safe_load(f) or {}
    http = config.get("http_options") or {}
    return str(http.get("host", DEFAULT_HOST)), int(http.get("port", DEFAULT_PORT))


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on (host, port) now; None when it could."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as error:
            return error
    return None


def port_problem(host: str, port: int) -> str | None:
    """One line saying why roseray cannot serve on (host, port), or None when it can."""
    error = bind_error(host, port)
    if error is None:
        return None
    where = f"{host}:{port}"
    if error.errno == errno.EADDRINUSE:
        holder = port_holder(port)
        held_by = f" by {holder.name} (pid {holder.pid})" if holder else ""
        hint = " (a roseray started with `make serve-bg`: `make stop`)" if holder and holder.name == "haproxy" else ""
        return (f"roseray: port {port} is taken{held_by}{hint}; stop it, or set http_options.port "
                f"in the Serve config (cannot listen on {where})")
    if error.errno == errno.EADDRNOTAVAIL or _not_an_address(host):
        return f"roseray: cannot listen on {where}: {host} is not an address of this machine"
    return f"roseray: cannot listen on {where}: {error.strerror}"


def _not_an_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m roseray.ray_serve.preflight SERVE_CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        host, port = serving_address(args[0])
    except (OSError, yaml.YAMLError, ValueError, TypeError) as error:
        print(f"roseray: cannot read the Serve config {args[0]}: {error}", file=sys.stderr)
        return 1
    problem = port_problem(host, port)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
