"""The tensor-parallel group this process belongs to, and its two collectives.

An engine replica of `tensor_parallel_size` N runs N processes, one per GPU (rank 0 the engine,
the others its workers); each holds 1/N of every sharded layer (roseray.layers.tensor_parallel)
and they meet in an all-reduce after each row-parallel projection and an all-gather of the
vocabulary-parallel logits. torch.distributed carries them: NCCL on GPUs, gloo on CPU.

A process that never joins a group is rank 0 of 1: the collectives are no-ops and the layers
are whole, so single-GPU code pays nothing. On GPUs, if ROSERAY_TP_ALL_REDUCE asks for it, the
all-reduce of a tensor up to a few MiB (every decode step's) goes through symmetric memory instead
of NCCL (symmetric_all_reduce.py, triton_all_reduce.py); each step's plan travels host to host over
a gloo group of the same ranks (`broadcast(host=True)`). With the triton method, an all-reduce that
a residual add and an RMSNorm follow can run fused with them (`all_reduce_add_rmsnorm`).

A rank that dies leaves the others waiting in a collective it never joins. Over gloo the wait
ends by itself: the dead process's sockets close and the collective raises. Over NCCL it never
ends; rank 0's watchdog (roseray.engine.rank_watchdog) calls `abort_tensor_parallel` from its own
thread, which aborts the communicator (the blocked kernels quit) and fails every later collective.
The abort also sets the abort flag of roseray's own symmetric-memory all-reduce (opt-in,
ROSERAY_TP_ALL_REDUCE=triton), whose kernel then stops waiting. torch's symmetric-memory
all-reduce (opt-in, symmetric / one_shot / two_shot) that a dead rank never joins is not ended by
it: its kernel waits on the peer's signal until the process goes (the health check fails; Serve
replaces it). Either way the buffer is never freed after an abort (freeing would wait for that
kernel, or on the dead rank).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from roseray import envs
from roseray.symmetric_all_reduce import SymmetricAllReduce, symmetric_all_reduce
from roseray.triton_all_reduce import TritonAllReduce


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group (None: the default group)
    host_group: Any = None  # the same ranks over gloo, for host tensors (each step's plan)

    @property
    def backend(self) -> str | None:
        return dist.get_backend(self.group) if self.size > 1 else None

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, rows, columns), which N must divide."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide the model's {what} ({total})")
        return total // self.size


# How long a collective may wait for the other ranks: unbounded in effect. A worker waits in the step
# broadcast for as long as its engine is idle, and the first collectives wait for the slowest rank's
# model load; the defaults (gloo 30 min, NCCL 10 min, after which NCCL's watchdog ends the process)
# would end an idle replica's workers. A dead rank is the rank watchdog's to catch, a live one that
# hangs the health check's (stuck_after_s); the rendezvous at init keeps its default timeout.
COLLECTIVE_TIMEOUT = timedelta(days=365)

_CURRENT = TensorParallel()
_TEARDOWN = threading.Lock()  # an abort (the watchdog's thread) and a shutdown (the engine's) one at a time
_aborted = False  # the group was aborted: every collective from now on raises
_SYMMETRIC: SymmetricAllReduce | TritonAllReduce | None = None
_ABANDONED: list[SymmetricAllReduce | TritonAllReduce] = []  # after an abort: a kernel may wait on it for good


def tensor_parallel() -> TensorParallel:
    return _CURRENT


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str | None = None) -> TensorParallel:
    """Join the group of `size` processes (every rank calls this with the same init_method, e.g.
    tcp://127.0.0.1:PORT or file:///path); backend: nccl on CUDA, gloo on CPU by default."""
    global _CURRENT, _aborted, _SYMMETRIC
    _aborted = False
    if size > 1:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)
        # the plan travels host to host, so that no rank waits on its device to read it (a worker
        # waits there while the engine idles; a dead peer ends the wait at once)
        host_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo",
                                                                              timeout=COLLECTIVE_TIMEOUT)
        _CURRENT = TensorParallel(rank, size, dist.group.WORLD, host_group)
    else:
        _CURRENT = TensorParallel(rank, size)
    if _CURRENT.backend == "nccl":  # every rank, in the same order: its setup is a collective
        _SYMMETRIC = symmetric_all_reduce(_CURRENT.group, torch.device("cuda", torch.cuda.current_device()),
                                          envs.tp_all_reduce())
    return _CURRENT


def shutdown_tensor_parallel(abort: bool = False) -> None:
    """Leave the group: every rank once its last step is done and (NCCL) its CUDA graphs that
    captured the group's collectives are destroyed, for NCCL's teardown waits for both. `abort`
    (a rank is gone): NCCL aborts the communicator instead of a teardown that would wait for it."""
    global _CURRENT, _SYMMETRIC
    if abort and _SYMMETRIC is not None:
        _SYMMETRIC.abort()  # a kernel of it that still waits on the gone rank stops (if it can)
        _ABANDONED.append(_SYMMETRIC)
    _SYMMETRIC = None  # its buffer is freed before the group goes (unless abandoned)
    with _TEARDOWN:  # after an abort in progress (NCCL's waits for the CUDA graphs, released before this)
        if _CURRENT.size > 1 and dist.is_initialized():
            if abort and _CURRENT.backend == "nccl":
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        _CURRENT = TensorParallel()


def abort_tensor_parallel(tp: TensorParallel) -> None:
    """From any thread, when a rank of `tp` (what init_tensor_parallel returned) has died: every
    collective from now on raises, the symmetric-memory all-reduce's kernels stop waiting (where
    they can: the triton method's), and NCCL's communicator is aborted, so that a collective this
    rank waits in ends (its kernels quit; NCCL allows the abort beside a blocked caller). Gloo's
    group is left alone: its transport already fails a collective whose peer exited, and it is not
    safe to destroy beside a collective. Nothing if this process has left `tp` meanwhile."""
    global _aborted
    with _TEARDOWN:
        if _CURRENT is not tp or tp.size == 1 or not dist.is_initialized():
            return
        _aborted = True
        if _SYMMETRIC is not None:  # first: a kernel of it may hold up what follows on this rank's device
            _SYMMETRIC.abort()
        if tp.backend == "nccl":
            dist.distributed_c10d._abort_process_group()


def _check_not_aborted() -> None:
    if _aborted:
        raise RuntimeError("the tensor-parallel group was aborted: a rank died")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks (a row-parallel projection's partial products): x in place, or a new
    tensor from symmetric memory; use the result."""
    tp = _CURRENT
    if tp.size > 1:
        _check_not_aborted()
        if _SYMMETRIC is not None and _SYMMETRIC.takes(x):
            return _SYMMETRIC(x)
        dist.all_reduce(x, group=tp.group)
    return x


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rmsnorm(sum over ranks of x + residual) * weight, that sum + residual) in one launch, where the
    group's all-reduce fuses the residual add and RMSNorm that follow it: the triton method, on rows its
    fused kernel takes (roseray_kernels.tp_all_reduce_norm). None everywhere else (one rank, NCCL, gloo,
    torch's symmetric memory, tensors too large or of another layout): the caller all-reduces, then norms
    (roseray.layers.norms.RMSNorm.all_reduce_add). Every rank decides alike, from shapes and dtypes only
    (no host sync), so the ranks' calls stay matched."""
    if _CURRENT.size == 1 or not isinstance(_SYMMETRIC, TritonAllReduce):
        return None
    _check_not_aborted()
    if not _SYMMETRIC.takes_rows(x, residual, weight):
        return None
    return _SYMMETRIC.add_rmsnorm(x, residual, weight, eps)


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x concatenated along the last dimension, in rank order (the logits)."""
    tp = _CURRENT
    if tp.size == 1:
        return x
    _check_not_aborted()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory allows)."""
    tp = _CURRENT
    if tp.size == 1:
        return value
    device = "cuda" if tp.backend == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=tp.group)
    return int(tensor.item())


def broadcast(x: torch.Tensor, host: bool = False) -> torch.Tensor:
    """Rank 0's x into every rank's x, in place: queued on the device for a CUDA tensor, or with
    `host`, a CPU tensor over the host group (the device not involved)."""
    tp = _CURRENT
    if tp.size > 1:
        _check_not_aborted()
        dist.broadcast(x, src=0, group=tp.host_group if host else tp.group)
    return x
