"""`python -m roseray.ray_serve.preflight CONFIG` (run by `make serve` and `make serve-bg` before
Ray starts): a taken serving port is one line naming the port and its holder, and exit 1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from roseray.ray_serve import preflight
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, port: int, host: str = "127.0.0.1") -> Path:
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"].update(host=host, port=port)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _preflight(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "roseray.ray_serve.preflight", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_the_shipped_config_is_read():
    assert preflight.serving_address(str(REPO / "serve_config.yaml")) == ("127.0.0.1", 8000)


def test_a_free_port_passes_silently(tmp_path):
    out = _preflight(_config(tmp_path, free_port()))
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def test_a_taken_port_is_one_line_naming_the_port_and_its_holder_and_exit_1(tmp_path):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        out = _preflight(_config(tmp_path, port))
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert f"port {port} is taken by " in lines[0]
    assert f"(pid {os.getpid()})" in lines[0]  # this test process listens there


def test_a_wildcard_listener_blocks_the_loopback_port_too(tmp_path):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", port))
        holder.listen()
        problem = preflight.port_problem("127.0.0.1", port)
    assert problem and f"port {port} is taken" in problem and f"pid {os.getpid()}" in problem


def test_connections_in_time_wait_do_not_count(tmp_path):
    """A server stopped a moment ago leaves connections in TIME_WAIT; HAProxy binds anyway
    (SO_REUSEADDR), so the check must too."""
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end goes to TIME_WAIT
    client.close()
    server.close()
    assert preflight.port_problem("127.0.0.1", port) is None


def test_an_address_not_on_this_machine_is_one_line(tmp_path):
    out = _preflight(_config(tmp_path, free_port(), host="203.0.113.7"))  # TEST-NET-3: no machine has it
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1
    assert "203.0.113.7 is not an address of this machine" in out.stderr


def test_an_unreadable_config_is_one_line(tmp_path):
    out = _preflight(tmp_path / "missing.yaml")
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1 and "missing.yaml" in out.stderr


def test_make_serve_on_a_taken_port_stops_before_ray(tmp_path):
    """`make serve` runs the check first: the one line, no Ray start, no traceback."""
    port = free_port()
    venv = os.path.dirname(os.path.dirname(sys.executable))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        out = subprocess.run(["make", "--no-print-directory", "-o", "install", "serve", f"VENV={venv}",
                              f"SERVE_CONFIG={_config(tmp_path, port)}", f"HAPROXY_DIR={tmp_path / 'hap'}"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.count(f"roseray: port {port} is taken by ") == 1, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert "serve run" not in out.stdout.splitlines()[-1], "make went on to serve run"
    assert not (tmp_path / "hap").exists(), "haproxy_env ran: the check must come first"
