"""`make serve`: `serve run CONFIG` in the foreground, stopped the same way by Ctrl-C and SIGTERM.

    python -m roseray.ray_serve.foreground serve_config.yaml

`serve run` shuts Serve down gracefully on SIGINT (replicas drain their requests for
drain_timeout_s), but on SIGTERM Ray's driver exits at once and the local Ray goes with it,
cutting the streams in flight. This runs `serve run` in a process group of its own (so that
the terminal's Ctrl-C reaches only this process) with haproxy_env's variables, after
preflight's port check, and turns the first SIGINT or SIGTERM into one SIGINT for it; a
second signal sends SIGTERM (stop now). Its exit status is `serve run`'s.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from roseray import envs
from roseray.ray_serve.haproxy_env import default_state_dir, haproxy_env
from roseray.ray_serve.preflight import port_problem, serving_address


def run(config: str, state_dir: str) -> int:
    problem = port_problem(*serving_address(config))
    if problem:
        print(problem, file=sys.stderr)
        return 1
    env = envs.child_environment(haproxy_env(state_dir))
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    signals: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame) -> None:
        signals.append(signum)
        if child is not None:
            child.send_signal(signal.SIGINT if len(signals) == 1 else signal.SIGTERM)

    # handlers, not SIG_IGN, while the child starts: exec resets handlers, but keeps ignored signals
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    child = subprocess.Popen([serve, "run", config], env=env, process_group=0)
    if signals:  # a signal came while it started
        child.send_signal(signal.SIGINT)
    return child.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.ray_serve.foreground",
                                     description="serve run CONFIG, stopped gracefully by SIGINT and SIGTERM")
    parser.add_argument("config")
    parser.add_argument("--dir", dest="state_dir", default=default_state_dir(),
                        help="haproxy_env's HAProxy directory (default: %(default)s)")
    args = parser.parse_args(argv)
    return run(args.config, args.state_dir)


if __name__ == "__main__":
    sys.exit(main())
