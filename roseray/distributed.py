"""The tensor-parallel group this process belongs to, and its two collectives.

An engine replica of `tensor_parallel_size` N runs N processes, one per GPU (rank 0 the engine,
the others its workers); each holds 1/N of every sharded layer (roseray.layers.tensor_parallel)
and they meet in an all-reduce after each row-parallel projection and an all-gather of the
vocabulary-parallel logits. torch.distributed carries them: NCCL on GPUs, gloo on CPU.

A process that never joins a group is rank 0 of 1: the collectives are no-ops and the layers
are whole, so single-GPU code pays nothing. On GPUs the all-reduce of a tensor up to a few MiB
(every decode step's) goes through symmetric memory instead of NCCL (symmetric_all_reduce.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from roseray import envs
from roseray.symmetric_all_reduce import SymmetricAllReduce, symmetric_all_reduce


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group (None: the default group)
    host_group: Any = None  # the same ranks over gloo, for host tensors (each step's plan)

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, rows, columns), which N must divide."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide the model's {what} ({total})")
        return total // self.size


HOST_GROUP_TIMEOUT = timedelta(days=365)
_CURRENT = TensorParallel()
_SYMMETRIC: SymmetricAllReduce | None = None


def tensor_parallel() -> TensorParallel:
    return _CURRENT


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str | None = None) -> TensorParallel:
    """Join the group of `size` processes (every rank calls this with the same init_method, e.g.
    tcp://127.0.0.1:PORT or file:///path); backend: nccl on CUDA, gloo on CPU by default."""
    global _CURRENT, _SYMMETRIC
    if size > 1:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        # the plan travels host to host, so that no rank waits on its device to read it; a rank waits
        # in it while the engine idles, for as long as that lasts (a dead peer ends it at once)
        host_group = dist.new_group(backend="gloo", timeout=HOST_GROUP_TIMEOUT) if backend != "gloo" else None
    _CURRENT = TensorParallel(rank, size, dist.group.WORLD if size > 1 else None,
                              (host_group or dist.group.WORLD) if size > 1 else None)
    if size > 1 and backend == "nccl":  # every rank, in the same order: its setup is a collective
        _SYMMETRIC = symmetric_all_reduce(_CURRENT.group, torch.device("cuda", torch.cuda.current_device()),
                                          envs.tp_all_reduce())
    return _CURRENT


def shutdown_tensor_parallel(abort: bool = False) -> None:
    """Leave the group: every rank once its last step is done and (NCCL) its CUDA graphs that
    captured the group's collectives are destroyed, for NCCL's teardown waits for both. `abort`
    (a rank is gone): NCCL aborts the communicator instead of a teardown that would wait for it."""
    global _CURRENT, _SYMMETRIC
    _SYMMETRIC = None  # its buffer is freed before the group goes
    if _CURRENT.size > 1 and dist.is_initialized():
        if abort and dist.get_backend(_CURRENT.group) == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _CURRENT = TensorParallel()
_SYMMETRIC: SymmetricAllReduce | None = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks (a row-parallel projection's partial products): x in place, or a new
    tensor from symmetric memory; use the result."""
    tp = _CURRENT
    if tp.size > 1:
        if _SYMMETRIC is not None and _SYMMETRIC.takes(x):
            return _SYMMETRIC(x)
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x concatenated along the last dimension, in rank order (the logits)."""
    tp = _CURRENT
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (e.g. the KV blocks each rank's memory allows)."""
    tp = _CURRENT
    if tp.size == 1:
        return value
    device = "cuda" if dist.get_backend(tp.group) == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=tp.group)
    return int(tensor.item())


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x into every rank's x, in place (queued on the device for a CUDA tensor)."""
    tp = _CURRENT
    if tp.size > 1:
        dist.broadcast(x, src=0, group=tp.group)
    return x


def broadcast_host(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's CPU tensor x into every rank's x, in place, on the host (the device not involved)."""
    tp = _CURRENT
    if tp.size > 1:
        dist.broadcast(x, src=0, group=tp.host_group)
    return x
