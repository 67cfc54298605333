"""`serve run` in the background on this machine, and its stop (`make serve-bg`, `make stop`).

    python -m roseray.ray_serve.background start [serve_config.yaml]   # pid file + log in --run-dir
    python -m roseray.ray_serve.background stop

`start` checks the serving port (preflight.py), exports haproxy_env's variables and starts
`serve run` in a session of its own, recording its pid. Ray's processes (GCS, raylet, the
workers and what they start: HAProxy, engine processes) stay in that session, so `stop`
can find everything the server started:

  1. SIGINT to `serve run`: Serve shuts its applications down (replicas drain) and Ray stops;
  2. after `--grace-s`, SIGTERM (Ray's driver then exits at once and stops the local Ray);
  3. what is still in the session after that gets SIGTERM, then SIGKILL;
  4. an HAProxy of haproxy_env's directory whose HAProxyManager is gone (left by a run from
     before haproxy_env's wrapper made HAProxy follow its parent) gets the same.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

from roseray import envs
from roseray.ray_serve.haproxy_env import default_state_dir, haproxy_env
from roseray.ray_serve.preflight import port_problem, serving_address

DEFAULT_CONFIG = "serve_config.yaml"
GRACE_S = 30.0  # how long `stop` lets Serve shut down before SIGTERM
TERM_WAIT_S = 10.0  # how long a SIGTERM gets before SIGKILL
_POLL_S = 0.1


def default_run_dir() -> str:
    return f"/tmp/roseray-serve-{os.getuid()}"


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: state, ppid, pgrp, session, ..."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _all_pids() -> Iterable[int]:
    return (int(entry) for entry in os.listdir("/proc") if entry.isdigit())


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it only waits to be reaped)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def session_pids(session: int) -> list[int]:
    """Live processes of a session (its leader's pid), the leader included."""
    found = []
    for pid in _all_pids():
        fields = _stat_fields(pid)
        if fields is not None and fields[0] != "Z" and int(fields[3]) == session:
            found.append(pid)
    return sorted(found)


def cmdline(pid: int) -> list[str]:
    """The arguments of `pid` (one string holding them all when the process set its title, as
    Ray's processes do)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def haproxy_pids(state_dir: str) -> list[int]:
    """Live HAProxy processes whose config is in `state_dir` (haproxy_env's directory)."""
    prefix = os.path.join(os.path.abspath(state_dir), "")
    found = []
    for pid in _all_pids():
        args = cmdline(pid)
        if args and os.path.basename(args[0]) == "haproxy" and alive(pid):
            configs = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "-f"]
            if any(os.path.abspath(config).startswith(prefix) for config in configs):
                found.append(pid)
    return sorted(found)


def orphaned_haproxy_pids(state_dir: str) -> list[int]:
    """haproxy_pids whose parent is not a live HAProxyManager actor: left by a run that is gone
    (a running `make serve`'s HAProxy is not among them)."""
    orphans = []
    for pid in haproxy_pids(state_dir):
        fields = _stat_fields(pid)
        parent = int(fields[1]) if fields else 1
        if not " ".join(cmdline(parent)).startswith("ray::HAProxyManager") or not alive(parent):
            orphans.append(pid)
    return orphans


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until none of `pids` runs; the ones still running after `timeout_s`."""
    left = list(pids)
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in left if alive(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(_POLL_S)


def _signal(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def terminate(pids: Iterable[int], term_wait_s: float = TERM_WAIT_S) -> None:
    """SIGTERM, then SIGKILL for what is still running after `term_wait_s`."""
    pids = list(pids)
    _signal(pids, signal.SIGTERM)
    _signal(wait_gone(pids, term_wait_s), signal.SIGKILL)
    wait_gone(pids, term_wait_s)


class Paths:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.pid_file = os.path.join(run_dir, "serve.pid")
        self.log = os.path.join(run_dir, "serve.log")

    def read_pid(self) -> int | None:
        """The recorded `serve run`, if it still runs (a recycled pid is not taken for it)."""
        try:
            with open(self.pid_file) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return pid if alive(pid) and " run " in f" {' '.join(cmdline(pid))} " else None


def start(config: str, run_dir: str, state_dir: str) -> int:
    """Start `serve run <config>` in its own session; its pid (0: not started, printed why)."""
    paths = Paths(run_dir)
    running = paths.read_pid()
    if running:
        print(f"roseray: already running (pid {running}); `make stop` first", file=sys.stderr)
        return 0
    problem = port_problem(*serving_address(config))
    if problem:
        print(problem, file=sys.stderr)
        return 0
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    env = envs.child_environment(haproxy_env(state_dir))
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # inherited: `stop` stops it with SIGINT
    with open(paths.log, "ab") as log:
        process = subprocess.Popen([serve, "run", config], stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    with open(paths.pid_file, "w") as f:
        f.write(f"{process.pid}\n")
    host, port = serving_address(config)
    print(f"roseray: starting in the background (pid {process.pid}) on http://{host}:{port}; "
          f"log: {paths.log}; stop: make stop")
    return process.pid


def stop(run_dir: str, state_dir: str, grace_s: float = GRACE_S, term_wait_s: float = TERM_WAIT_S) -> bool:
    """Stop what `start` started (see the module docstring); whether something was running."""
    paths = Paths(run_dir)
    began = time.monotonic()
    pid = paths.read_pid()
    if pid is not None:
        os.kill(pid, signal.SIGINT)
        if wait_gone([pid], grace_s):
            os.kill(pid, signal.SIGTERM)
            if wait_gone([pid], term_wait_s):
                os.kill(pid, signal.SIGKILL)
        # Ray stops its processes once its driver is gone; what is left after that gets signals
        terminate(wait_gone(session_pids(pid), term_wait_s), term_wait_s)
    leftovers = orphaned_haproxy_pids(state_dir)
    terminate(leftovers, term_wait_s)
    try:
        os.unlink(paths.pid_file)
    except FileNotFoundError:
        pass
    if pid is None and not leftovers:
        print("roseray: nothing to stop")
        return False
    what = f"pid {pid}" if pid is not None else f"HAProxy left by an earlier run (pid {', '.join(map(str, leftovers))})"
    print(f"roseray: stopped {what} in {time.monotonic() - began:.1f} s")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.ray_serve.background",
                                     description="run roseray's Serve app in the background, or stop it")
    parser.add_argument("--run-dir", default=default_run_dir(),
                        help="where the pid file and the log are (default: %(default)s)")
    parser.add_argument("--dir", dest="state_dir", default=default_state_dir(),
                        help="haproxy_env's HAProxy directory (default: %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    start_parser = commands.add_parser("start", help="start `serve run CONFIG` in the background")
    start_parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    stop_parser = commands.add_parser("stop", help="stop it and everything it started")
    stop_parser.add_argument("--grace-s", type=float, default=GRACE_S,
                             help="how long Serve may take to shut down before SIGTERM (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.command == "start":
        return 0 if start(args.config, args.run_dir, args.state_dir) else 1
    stop(args.run_dir, args.state_dir, args.grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
