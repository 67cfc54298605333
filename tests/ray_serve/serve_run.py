"""`serve run` of serve_config.yaml as a user starts it, for the start/stop tests: the shipped
config with a small CPU engine and free ports, haproxy_env's environment, its own session
(so that every process it starts can be found by session id) and a private Ray temp dir."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from roseray.ray_serve.background import cmdline, haproxy_pids, session_pids
from roseray.ray_serve.haproxy_env import haproxy_env
from tests.conftest import free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
SMALL_ENGINE = {"model": "random:tiny", "max_num_seqs": 4, "max_waiting_requests": 16, "max_model_len": 2048,
                "num_kv_blocks": 140, "block_size": 16}
START_TIMEOUT_S = 300  # a Ray start on a busy 2-core box


def small_config(path: Path, port: int) -> Path:
    """serve_config.yaml with one CPU replica of random:tiny on `port`; everything else as shipped."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    args["engine"].update(SMALL_ENGINE)
    args["num_replicas"] = 1
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def serve_env(state_dir: str, ray_tmp: str) -> dict[str, str]:
    """What `make serve` exports (haproxy_env, one Router) with HAProxy's side ports and Serve's
    fallback proxy moved to free ports and Ray's files in `ray_tmp`."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, **haproxy_env(state_dir, router_replicas_per_node=1),
           "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()), "RAY_TMPDIR": ray_tmp,
           "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    return env


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ServeRun:
    """One `serve run`; `session` is its pid (it leads a session of its own)."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = tempfile.mkdtemp(prefix="rrh", dir="/tmp")  # short: HAProxy's socket paths
        self.ray_tmp = tempfile.mkdtemp(prefix="rrt", dir="/tmp")
        self.config = small_config(tmp_path / "serve_config.yaml", self.port)
        self.env = serve_env(self.state_dir, self.ray_tmp)
        self.log_path = tmp_path / "serve.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """`serve run <config>` with haproxy_env's environment."""
        self._start([os.path.join(os.path.dirname(sys.executable), "serve"), "run", str(self.config)])

    def start_make(self) -> None:
        """`make serve` (its install step taken as done, this interpreter's venv): preflight, haproxy_env,
        `serve run`; `session` is then make's pid."""
        venv = os.path.dirname(os.path.dirname(sys.executable))
        self._start(["make", "--no-print-directory", "-o", "install", "serve", f"VENV={venv}",
                     f"SERVE_CONFIG={self.config}", f"HAPROXY_DIR={self.state_dir}"])

    def _start(self, command: list[str]) -> None:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def session(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S, in_a_row: int = 3) -> None:
        """Until completions come back through HAProxy `in_a_row` times in a row (for a moment after
        the first, HAProxy may still send one past the Router: 503 not_routed)."""
        successes = [0]

        def serving() -> bool:
            assert self.process.poll() is None, f"serve run exited:\n{self.log()[-4000:]}"
            try:
                reply = httpx.post(f"{self.url}/v1/completions", timeout=10,
                                   json={"model": SMALL_ENGINE["model"], "prompt": "hi", "max_tokens": 1})
                successes[0] = successes[0] + 1 if reply.status_code == 200 else 0
            except httpx.HTTPError:
                successes[0] = 0
            return successes[0] >= in_a_row

        wait_until(serving, timeout=timeout_s, interval=0.1, message=lambda: f"serving:\n{self.log()[-4000:]}")

    def signal_and_wait(self, signum: int, timeout_s: float) -> float:
        """Send `signum` to the process started (`serve run`, or make); seconds until it exited
        (AssertionError past `timeout_s`)."""
        began = time.monotonic()
        self.process.send_signal(signum)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            name = signal.Signals(signum).name
            raise AssertionError(f"{self.process.args[0]} still running {timeout_s} s after {name}:\n"
                                 f"{self.log()[-4000:]}") from None
        return time.monotonic() - began

    def leftovers(self) -> list[str]:
        """Processes of its session and HAProxy processes of its state dir that still run."""
        pids = set(session_pids(self.session)) | set(haproxy_pids(self.state_dir))
        return [f"{pid}: {' '.join(cmdline(pid))[:160]}" for pid in sorted(pids)]

    def wait_no_leftovers(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.leftovers()

    def cleanup(self) -> None:
        """Kill whatever a failed test left (the session, HAProxy of its dir) and remove the dirs."""
        if self.process is not None:
            for pid in set(session_pids(self.session)) | set(haproxy_pids(self.state_dir)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.wait(30)
        shutil.rmtree(self.state_dir, ignore_errors=True)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)

