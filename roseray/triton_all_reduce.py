"""The tensor-parallel all-reduce of small tensors through roseray's own kernel, which an abort ends.

`ROSERAY_TP_ALL_REDUCE=triton` sends every all-reduce that fits the buffer (8 MiB: every decode
step's) through roseray_kernels.tp_all_reduce, a one-shot all-reduce over torch's symmetric memory
(each rank reads every peer's buffer over NVLink and sums), and the rest through NCCL. Unlike
torch's symmetric-memory kernels (symmetric_all_reduce.py), every wait in it also watches an abort
flag in pinned host memory: `abort()`, which roseray.distributed.abort_tensor_parallel calls from
the rank watchdog's thread when a rank dies, sets it with a plain host store (no CUDA call, so
nothing queues it behind the kernel that waits), and a kernel waiting on the dead rank returns
within POLL_EVERY spins, as do those queued after it (a CUDA graph's). What they computed is
garbage, which the aborted group's step raises over (as after NCCL's abort).

`add_rmsnorm` is the same all-reduce fused with the residual add and RMSNorm that follow it in a
decoder layer (roseray_kernels.tp_all_reduce_norm; roseray.distributed.all_reduce_add_rmsnorm): it
shares the buffer, the signal pad and the call parity, so its calls and the plain ones interleave.

Setup is a collective (symm_mem.empty + rendezvous), made by every rank in the same order at
group start; the buffer (two halves: the kernel alternates them, see the kernel's docstring), its
signal pad, the call-parity state and the flag stay for the group's life, so the calls are
captured in CUDA graphs. After an abort the object is not used again (its pads are left mid-call)
and its buffer is not freed (roseray.distributed keeps it). As with torch's kernels
(symmetric_all_reduce.py), one tensor-parallel engine per process: a second group of the same name
hangs in torch's rendezvous.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed._symmetric_memory as symm_mem

from roseray_kernels.tp_all_reduce import PeerBuffers, one_shot_all_reduce, signal_pad_bytes, takes
from roseray_kernels.tp_all_reduce_norm import all_reduce_add_rmsnorm, takes_rows

BUFFER_BYTES = 8 << 20  # the largest tensor taken: a decode batch of 1024 tokens x 4096 hidden in bf16
MAX_WORLD_SIZE = 8


class TritonAllReduce:
    """The sum over ranks of a tensor that fits the buffer, returned as a new tensor; abortable."""

    def __init__(self, group, device: torch.device, buffer_bytes: int = BUFFER_BYTES,
                 max_programs: int | None = None) -> None:
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before torch 2.12; deprecated (and a no-op) since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.buffer = symm_mem.empty(2 * buffer_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.handle = handle
        rank, world_size = handle.rank, handle.world_size
        if not 2 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"the all-reduce kernel takes 2 to {MAX_WORLD_SIZE} ranks, the group has {world_size}")
        if max_programs is None:  # one program per SM at most (every program of a launch must be resident at
            # once), and no more than the signal pad has slots for
            max_programs = min(torch.cuda.get_device_properties(device).multi_processor_count,
                               handle.signal_pad_size // signal_pad_bytes(1, world_size))
        if not 0 < signal_pad_bytes(max_programs, world_size) <= handle.signal_pad_size:
            raise ValueError(f"a signal pad of {handle.signal_pad_size} bytes is too small for {max_programs} programs "
                             f"x {world_size} ranks")
        # buffer_ptrs are the bases of each rank's allocation; the buffer sits at the same offset in each,
        # for every rank made the same allocations
        offset = self.buffer.data_ptr() - handle.buffer_ptrs[rank]
        if offset < 0:
            raise ValueError(f"the buffer lies before its allocation's base ({offset} bytes)")
        self.abort_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.peers = PeerBuffers(
            rank=rank, world_size=world_size,
            buffer_ptrs=torch.tensor([ptr + offset for ptr in handle.buffer_ptrs], dtype=torch.int64, device=device),
            signal_pad_ptrs=torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device),
            half_bytes=buffer_bytes, state=torch.zeros(2, dtype=torch.int32, device=device),
            abort_flag=self.abort_flag, max_programs=max_programs)

    def takes(self, x: torch.Tensor) -> bool:
        return takes(x, self.peers)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return one_shot_all_reduce(x, self.peers)

    def takes_rows(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        return takes_rows(x, residual, weight, self.peers)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(sum over ranks of x + residual) * weight, that sum + residual): the all-reduce, the
        residual add and the RMSNorm after it in one launch (rows that `takes_rows`)."""
        return all_reduce_add_rmsnorm(x, residual, weight, eps, self.peers)

    def abort(self) -> None:
        """From any thread: a kernel of this all-reduce that waits now returns, and so does every later
        one (their results are garbage). A host store into pinned memory; never undone."""
        self.abort_flag.fill_(1)

    @property
    def aborted(self) -> bool:
        return bool(self.abort_flag.item())
