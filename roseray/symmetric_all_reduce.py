"""The tensor-parallel all-reduce of small tensors through symmetric memory (GPUs with NVLink).

A decode step's all-reduces are small (a [batch, hidden] bf16 tensor: 8 KiB to 8 MiB) and
there are two per layer, so their latency, not bandwidth, is what they cost. NCCL's ring
all-reduce pays its protocol's latency on each; torch's symmetric memory instead maps one
buffer of every rank into every rank's address space (`torch.distributed._symmetric_memory`:
`empty` + `rendezvous`, a collective at group start), and its all-reduce kernels read the
peers' buffers directly over NVLink, with a barrier on per-buffer signal pads:

- one-shot (`one_shot_all_reduce_copy_out`): each rank copies its tensor into its buffer, and
  after the barrier every rank reads all N buffers and sums them: one kernel, each rank reads
  N x the tensor; best for the smallest tensors.
- two-shot (`two_shot_all_reduce_out`): a reduce-scatter then an all-gather through the
  buffers: each rank reads ~2 x the tensor whatever N; better once bandwidth counts.

Both are CUDA-graph capturable (the graphs capture the kernels; the buffer and signal pads stay
allocated for the group's life). Tensors larger than the buffer, or of a dtype the kernels do not
take (they take float32 and bfloat16), go through NCCL. `ROSERAY_TP_ALL_REDUCE` (envs.py) picks
the method: nccl (the default: nothing here is used), symmetric (one-shot up to
ONE_SHOT_MAX_BYTES, then two-shot up to the buffer), one_shot, two_shot, or triton (roseray's own
one-shot kernel, which an abort ends: triton_all_reduce.py).

Why it is not the default: torch's kernels wait on a peer's signal with no way out. A rank that
dies while the others are inside one leaves their GPUs spinning in it for good (an NCCL abort
ends NCCL's kernels, not these), so rank 0's step never returns, its streams end only when Serve
replaces the replica after the health check fails, and freeing the buffer (a device-wide
synchronization) would hang too (shutdown after an abort keeps it). What it saves against NCCL
is in BENCHMARKS.md. A second tensor-parallel engine in the same process (after the first stopped) hangs in
`rendezvous` (torch 2.13 keeps the first group's state under the same group name; seen on 2x
H100): with this opt-in, one tensor-parallel engine per process.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from roseray.envs import TP_ALL_REDUCE_ENV
from roseray.triton_all_reduce import BUFFER_BYTES, TritonAllReduce

logger = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 512 << 10
METHODS = ("nccl", "symmetric", "one_shot", "two_shot", "triton")
DTYPES = (torch.bfloat16, torch.float32)


class SymmetricAllReduce:
    """The sum over ranks of a tensor that fits the buffer, returned as a new tensor."""

    def __init__(self, group, device: torch.device, method: str = "symmetric",
                 buffer_bytes: int = BUFFER_BYTES) -> None:
        self.method, self.group_name = method, group.group_name
        self.ops = torch.ops.symm_mem
        for name in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out"):
            getattr(self.ops, name)  # this torch has the kernels (AttributeError: it has not)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before torch 2.12; deprecated (and a no-op) since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.buffer = symm_mem.empty(buffer_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and x.is_contiguous() and x.nbytes <= self.buffer.numel() and x.nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staging = self.buffer[:x.nbytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        if self.method == "one_shot" or (self.method == "symmetric" and x.nbytes <= ONE_SHOT_MAX_BYTES):
            return self.ops.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)
        staging.copy_(x)
        return self.ops.two_shot_all_reduce_out(staging, "sum", self.group_name, out)

    def abort(self) -> None:
        """Nothing: torch's kernels cannot be made to stop waiting (see the module's docstring)."""


def symmetric_all_reduce(group, device: torch.device, method: str) -> SymmetricAllReduce | TritonAllReduce | None:
    """The group's symmetric-memory all-reduce for `method` (triton: TritonAllReduce), or None (NCCL
    for everything) when `method` is nccl or the platform cannot (no symmetric memory, no peer
    access): logged, never fatal."""
    if method not in METHODS:
        raise ValueError(f"{TP_ALL_REDUCE_ENV} must be one of {', '.join(METHODS)}, got {method!r}")
    if method == "nccl" or device.type != "cuda" or dist.get_backend(group) != "nccl":
        return None
    try:
        if method == "triton":
            return TritonAllReduce(group, device)
        return SymmetricAllReduce(group, device, method)
    except Exception as error:  # e.g. GPUs without peer access, a torch without the kernels
        logger.warning("tensor parallel: symmetric-memory all-reduce unavailable (%s); NCCL for every all-reduce",
                       error)
        return None

