"""Every environment variable roseray reads, declared and read here only.

Each variable has its name as a constant (`*_ENV`, for code that writes it or names it in
generated text) and a function that reads it at the moment it is called, so that a value
set before a child process starts, or by a test, is seen. No other module of roseray reads
`os.environ` (tests/config/test_envs.py checks it).
"""

from __future__ import annotations

import os

# the bearer key the server requires when neither --api-key nor the Ray app's api_key sets one
API_KEY_ENV = "ROSERAY_API_KEY"
# "1": the command line prints full tracebacks (as --debug does) instead of one-line errors
DEBUG_ENV = "ROSERAY_DEBUG"
# "iteration": the async engine holds every add to the end of its loop iteration (an A/B switch)
ADD_FLUSH_ENV = "ROSERAY_ADD_FLUSH"
# "0": the HAProxy wrapper drops Ray's splice options (read by the wrapper haproxy_env.py writes)
HAPROXY_SPLICE_ENV = "ROSERAY_HAPROXY_SPLICE"
# an HAProxy http-reuse mode for the routed backends (read by the wrapper haproxy_env.py writes)
HAPROXY_REUSE_ENV = "ROSERAY_HAPROXY_REUSE"
# Ray's: Router replicas Ray runs on each proxy node (read by Ray's controller at `ray start`)
ROUTER_REPLICAS_ENV = "RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE"
# tensor-parallel all-reduce on GPUs: "nccl" (default), or symmetric memory up to its buffer: torch's kernels,
# "symmetric" (one-shot or two-shot by size), "one_shot", "two_shot" (faster, but a dead rank hangs the
# replica), or roseray's own one-shot kernel, "triton" (ended by the abort when a rank dies)
TP_ALL_REDUCE_ENV = "ROSERAY_TP_ALL_REDUCE"
# CUDA's: the GPUs this process may use ("" or "-1": none)
CUDA_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# OpenMP's: torch's CPU threads (a GPU engine uses 1 unless this is set)
OMP_NUM_THREADS_ENV = "OMP_NUM_THREADS"


def api_key() -> str | None:
    """ROSERAY_API_KEY, or None when it is unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def debug() -> bool:
    """ROSERAY_DEBUG set to anything but "", "0", "false" or "no"."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def add_flush() -> str:
    """ROSERAY_ADD_FLUSH ("" when unset)."""
    return os.environ.get(ADD_FLUSH_ENV, "")


def router_replicas_per_node() -> int:
    """RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE (Ray's default, 1, when unset or empty)."""
    return int(os.environ.get(ROUTER_REPLICAS_ENV) or 1)


def tp_all_reduce() -> str:
    """ROSERAY_TP_ALL_REDUCE ("nccl" when unset or empty)."""
    return os.environ.get(TP_ALL_REDUCE_ENV) or "nccl"


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES, or None when it is unset."""
    return os.environ.get(CUDA_VISIBLE_DEVICES_ENV)


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's whole environment with `extra` set on top: what a child started with
    `extra` sees (serve run under haproxy_env's variables)."""
    return {**os.environ, **extra}


def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS as a positive int, or None when it is unset or not one."""
    value = os.environ.get(OMP_NUM_THREADS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None
