"""The tensor-parallel all-reduce fused with what follows it in a decoder layer: the residual add and
the next RMSNorm, in one launch (tp_all_reduce.py's protocol, rows instead of flat blocks).

    normed, residual = all_reduce_add_rmsnorm(x, residual, weight, eps, peers)
    # residual = all_reduce(x) + residual; normed = rmsnorm(residual) * weight

Program p takes rows p, p + grid, ...: it copies them into this rank's symmetric buffer, meets
program p of every peer (barrier_with_peers: the same signal slots, call parity and abort flag as
one_shot_all_reduce, so the two kernels' calls interleave freely), then per row sums the ranks'
rows in fp32, rounds the sum to the activation dtype (what the all-reduce returns), and carries on
as fused_norm's rmsnorm with a residual does: the residual sum rounded like torch's add, fp32
statistics, `x * rstd` rounded before the weight multiplies it. So the result equals
rmsnorm_reference(all_reduce_reference(xs), weight, eps, residual) but for the order of the sum of
squares, and the new residual equals it exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_norm import rmsnorm_reference
from .tp_all_reduce import (
    DTYPES,
    POLL_EVERY,
    PeerBuffers,
    all_reduce_reference,
    barrier_with_peers,
    call_parity,
    finish_call,
)


def takes_rows(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, peers: PeerBuffers) -> bool:
    """x and residual are [rows, hidden] contiguous tensors of one dtype (float32 or bfloat16), rows of a
    multiple of 16 bytes, x no more than half the buffer, weight [hidden] of that dtype."""
    return (x.dim() == 2 and x.dtype in DTYPES and x.is_contiguous() and residual.is_contiguous()
            and residual.shape == x.shape and residual.dtype == x.dtype and weight.shape == (x.shape[1],)
            and weight.dtype == x.dtype and (x.shape[1] * x.element_size()) % 16 == 0
            and 0 < x.nbytes <= peers.half_bytes)


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           peers: PeerBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(sum over ranks of x + residual) * weight, sum over ranks of x + residual), new tensors;
    every rank calls it with the same shapes, in the same order relative to its other calls."""
    if not takes_rows(x, residual, weight, peers):
        raise ValueError(f"all_reduce_add_rmsnorm takes contiguous [rows, hidden] float32/bfloat16 x and residual "
                         f"(rows of a multiple of 16 bytes, x up to {peers.half_bytes} bytes) and a [hidden] weight of "
                         f"their dtype, got x {x.dtype} {tuple(x.shape)}, residual {residual.dtype} "
                         f"{tuple(residual.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    rows, hidden = x.shape
    normed, new_residual = torch.empty_like(x), torch.empty_like(x)
    block_h = triton.next_power_of_2(hidden)
    num_warps = 8 if block_h <= 4096 else 16
    _all_reduce_add_rmsnorm_kernel[(min(rows, peers.max_programs),)](
        x, residual, weight, normed, new_residual, peers.buffer_ptrs, peers.signal_pad_ptrs, peers.state,
        peers.abort_flag, rows, peers.half_bytes // x.element_size(), eps,
        RANK=peers.rank, WORLD=peers.world_size, WORLD_P2=triton.next_power_of_2(peers.world_size), HIDDEN=hidden,
        BLOCK_H=block_h, POLL_EVERY=POLL_EVERY, THREADS=num_warps * 32, num_warps=num_warps)
    return normed, new_residual


def all_reduce_add_rmsnorm_reference(xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What every rank gets for the ranks' tensors `xs` (rank order)."""
    return rmsnorm_reference(all_reduce_reference(xs), weight, eps, residual)


@triton.jit(do_not_specialize=["num_rows"])
def _all_reduce_add_rmsnorm_kernel(
    x_ptr,  # [num_rows, HIDDEN] this rank's partial sums
    residual_ptr,  # [num_rows, HIDDEN]
    weight_ptr,  # [HIDDEN]
    out_ptr,  # [num_rows, HIDDEN] the normed rows
    residual_out_ptr,  # [num_rows, HIDDEN] the all-reduced rows + residual
    buffer_ptrs,  # int64 [WORLD]: each rank's symmetric buffer (two halves of half_elements)
    signal_pad_ptrs,  # int64 [WORLD]: each rank's signal pad, int32 slots [program, rank]
    state_ptr,  # int32 [2]: the call parity and the programs of this call finished (tp_all_reduce.py)
    abort_ptr,  # int32 [1], pinned host memory: not 0 once the host aborts
    num_rows,
    half_elements,
    eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
    POLL_EVERY: tl.constexpr, THREADS: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < HIDDEN
    parity = call_parity(state_ptr)
    half = parity.to(tl.int64) * half_elements
    # 16-byte aligned (see tp_all_reduce.py); HIDDEN, a constant, gives the rows' alignment
    mine = tl.multiple_of(tl.load(buffer_ptrs + RANK).to(tl.pointer_type(dtype)) + half, 16)
    for row in range(pid, num_rows, programs):  # my rows into my buffer
        offs = row * HIDDEN + cols
        tl.store(mine + offs, tl.load(x_ptr + offs, mask=col_ok), mask=col_ok)
    aborted = barrier_with_peers(signal_pad_ptrs, abort_ptr, pid, RANK, WORLD, WORLD_P2, POLL_EVERY, THREADS)
    if aborted == 0:
        weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        for row in range(pid, num_rows, programs):
            offs = row * HIDDEN + cols
            total = tl.zeros([BLOCK_H], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                buffer = tl.multiple_of(tl.load(buffer_ptrs + r).to(tl.pointer_type(dtype)) + half, 16)
                total += tl.load(buffer + offs, mask=col_ok, other=0.0).to(tl.float32)
            reduced = total.to(dtype)  # what the all-reduce alone returns
            residual = tl.load(residual_ptr + offs, mask=col_ok, other=0.0)
            summed = (reduced.to(tl.float32) + residual.to(tl.float32)).to(dtype)  # rounded like torch's add
            tl.store(residual_out_ptr + offs, summed, mask=col_ok)
            sf = summed.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / HIDDEN + eps)
            normed = (sf * rstd).to(dtype).to(tl.float32)
            tl.store(out_ptr + offs, (normed * weight).to(dtype), mask=col_ok)
    finish_call(state_ptr, parity)
