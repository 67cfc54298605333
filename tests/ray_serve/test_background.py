"""`python -m roseray.ray_serve.background stop` (`make stop`) without Ray: what it does when no
server was started in the background, with an HAProxy left by an earlier run, or beside a
running `make serve` (tests/ray_serve/test_serve_lifecycle.py stops real servers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from roseray.ray_serve import background
from roseray.ray_serve.haproxy_env import find_haproxy
from tests.conftest import free_port
from tests.ray_serve.serve_run import port_is_free
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
CONFIG = """defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend main
    bind 127.0.0.1:{port}
    http-request return status 200
"""


def _haproxy_under(state_dir: Path, parent_title: str | None) -> tuple[subprocess.Popen, int, int]:
    """An HAProxy with its config in `state_dir`, started by a process titled `parent_title` (bash's
    exec -a), or by this test directly (None); (the process started, HAProxy's pid, its port)."""
    port = free_port()
    state_dir.mkdir(exist_ok=True)
    config = state_dir / "haproxy.cfg"
    config.write_text(CONFIG.format(port=port))
    real = find_haproxy()
    if parent_title is None:
        process = subprocess.Popen([real, "-db", "-f", str(config)], stdout=subprocess.DEVNULL)
        haproxy = process.pid
    else:
        script = (f"import subprocess, sys; p = subprocess.Popen([{real!r}, '-db', '-f', {str(config)!r}]); "
                  "print(p.pid, flush=True); p.wait()")
        process = subprocess.Popen(["bash", "-c", f'exec -a "{parent_title}" {sys.executable} -c "{script}"'],
                                   stdout=subprocess.PIPE, text=True)
        haproxy = int(process.stdout.readline())
    wait_until(lambda: not port_is_free(port), timeout=20, interval=0.05, message="HAProxy started")
    return process, haproxy, port


def _stop(tmp_path: Path, state_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "roseray.ray_serve.background", "--run-dir", str(tmp_path / "run"),
                           "--dir", str(state_dir), "stop"], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_stop_with_nothing_running_says_so(tmp_path):
    out = _stop(tmp_path, tmp_path / "hap")
    assert out.returncode == 0 and out.stdout == "roseray: nothing to stop\n"


def test_stop_removes_an_haproxy_left_by_an_earlier_run(tmp_path):
    """An HAProxy whose HAProxyManager is gone (before the wrapper made it follow its parent,
    `ray stop --force` left one holding the port)."""
    process, haproxy, port = _haproxy_under(tmp_path / "hap", None)
    try:
        assert background.orphaned_haproxy_pids(str(tmp_path / "hap")) == [haproxy]
        out = _stop(tmp_path, tmp_path / "hap")
        assert out.returncode == 0 and f"HAProxy left by an earlier run (pid {haproxy})" in out.stdout
        process.wait(10)
        assert port_is_free(port)
    finally:
        if process.poll() is None:
            process.kill()


def test_stop_leaves_the_haproxy_of_a_running_server_alone(tmp_path):
    """A `make serve` in another terminal: its HAProxy's parent is a live HAProxyManager actor."""
    process, haproxy, port = _haproxy_under(tmp_path / "hap", "ray::HAProxyManager")
    try:
        assert background.haproxy_pids(str(tmp_path / "hap")) == [haproxy]
        assert background.orphaned_haproxy_pids(str(tmp_path / "hap")) == []
        out = _stop(tmp_path, tmp_path / "hap")
        assert out.stdout == "roseray: nothing to stop\n"
        assert background.alive(haproxy) and not port_is_free(port)
    finally:
        os.kill(haproxy, signal.SIGKILL)
        process.wait(10)


def test_a_recorded_pid_that_is_not_serve_run_is_not_signalled(tmp_path):
    """A pid file outliving its server, its pid reused by another process."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a process that just lives
    try:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "serve.pid").write_text(f"{other.pid}\n")
        out = _stop(tmp_path, tmp_path / "hap")
        assert out.stdout == "roseray: nothing to stop\n"
        assert other.poll() is None
        assert not (tmp_path / "run" / "serve.pid").exists()
    finally:
        other.kill()
        other.wait(10)
