"""Sorting a MoE step's (token, slot) assignments by expert, for the grouped expert GEMMs.

The `num_tokens * top_k` assignments (flat index `token * top_k + slot`) are ordered by
expert, each expert's run padded to a multiple of `block_m` with the invalid index
`num_assignments`, so that every tile of `block_m` rows of the GEMMs belongs to one expert:

- sorted_ids [capacity]: assignment indices by expert (stable: in assignment order within
  an expert), padding = num_assignments; entries past the padded count are padding too.
- block_expert [max_blocks]: the expert of each block of `block_m` sorted rows.
- padded_count [1]: the number of sorted rows in use (device memory: the GEMMs read it and
  their blocks past it exit at once).

Buffer sizes come from shapes only (CUDA-graph capturable, no host syncs): each expert that
has assignments adds at most one partial block, so at most
`num_assignments // block_m + min(num_experts, num_assignments)` blocks are used.

Two implementations with equal results: one Triton program (a counting sort in registers:
a few microseconds for decode-sized steps, but it runs on one SM, so it is linear in the
assignments) and torch ops (a stable sort and scatters: a dozen launches, parallel for large
steps). `moe_align` picks by size; `ALIGN_TRITON_MAX_ASSIGNMENTS` is untuned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ALIGN_TRITON_MAX_ASSIGNMENTS = 4096  # untuned: the one-program kernel up to here, torch ops above
ALIGN_CHUNK = 64  # assignments (and blocks) per loop step of the one-program kernel
ALIGN_NUM_WARPS = 4


@dataclass(frozen=True)
class AlignedAssignments:
    sorted_ids: torch.Tensor  # [max_blocks * block_m] int32
    block_expert: torch.Tensor  # [max_blocks] int32
    padded_count: torch.Tensor  # [1] int32
    block_m: int
    num_assignments: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_assignments: int, num_experts: int, block_m: int) -> int:
    """The most blocks of `block_m` rows the padded runs can fill (a shape-only bound)."""
    return num_assignments // block_m + min(num_experts, num_assignments)


@triton.jit
def _align_kernel(
    ids_ptr,  # [num_assignments] expert of each assignment (any int dtype)
    sorted_ptr,  # [num_blocks * BLOCK_M] int32 out
    block_expert_ptr,  # [num_blocks] int32 out
    padded_ptr,  # [1] int32 out
    num_assignments, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr,
):
    """One program: count per expert, pad and prefix-sum, then place each assignment at its
    expert's start + the number of earlier assignments of that expert (a stable counting sort)."""
    experts = tl.arange(0, EXPERTS_P2)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([EXPERTS_P2], dtype=tl.int32)
    for start in range(0, num_assignments, CHUNK):
        offs = start + lanes
        ids = tl.load(ids_ptr + offs, mask=offs < num_assignments, other=EXPERTS_P2).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(padded_ptr, total)

    # block b holds rows from b * BLOCK_M: its expert is the number of runs ending at or before it
    # (EXPERTS_P2 past the padded count). Rows of a run past its expert's count are padding, and so
    # are all rows past the padded count; the placements below write the others (disjoint stores).
    starts = ends - padded
    for start in range(0, num_blocks, CHUNK):
        blocks = start + lanes
        in_range = blocks < num_blocks
        expert = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.minimum(expert, num_experts - 1), mask=in_range)
        onehot = (expert[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EXPERTS_P2]
        run_start = tl.sum(onehot * starts[None, :], axis=1)
        run_count = tl.sum(onehot * counts[None, :], axis=1)
        rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [CHUNK, BLOCK_M]
        is_padding = rows - run_start[:, None] >= run_count[:, None]
        tl.store(sorted_ptr + rows, tl.zeros([CHUNK, BLOCK_M], dtype=tl.int32) + num_assignments,
                 mask=is_padding & in_range[:, None])

    cursor = starts  # next free row of each expert
    for start in range(0, num_assignments, CHUNK):
        offs = start + lanes
        valid = offs < num_assignments
        ids = tl.load(ids_ptr + offs, mask=valid, other=EXPERTS_P2).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EXPERTS_P2]
        earlier = tl.cumsum(onehot, axis=0) - onehot  # same-expert assignments before each, in this chunk
        dest = tl.sum(onehot * (cursor[None, :] + earlier), axis=1)
        tl.store(sorted_ptr + dest, offs, mask=valid)
        cursor += tl.sum(onehot, axis=0)


def align_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedAssignments:
    flat = ids.reshape(-1)
    num_assignments = flat.numel()
    blocks = max_blocks(num_assignments, num_experts, block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    padded_count = torch.empty(1, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](flat, sorted_ids, block_expert, padded_count, num_assignments, num_experts, blocks,
                        BLOCK_M=block_m, EXPERTS_P2=triton.next_power_of_2(num_experts), CHUNK=ALIGN_CHUNK,
                        num_warps=ALIGN_NUM_WARPS)
    return AlignedAssignments(sorted_ids, block_expert, padded_count, block_m, num_assignments)


def align_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedAssignments:
    """The same layout from torch ops without host syncs (scatter_add for the counts: CUDA's
    bincount reads its input's max on the host)."""
    flat = ids.reshape(-1).long()
    num_assignments, device = flat.numel(), flat.device
    blocks = max_blocks(num_assignments, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(num_assignments, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_ids = torch.full((blocks * block_m,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, (ends - padded)[sorted_experts] + rank, order.int())
    block_starts = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).int()
    return AlignedAssignments(sorted_ids, block_expert, ends[-1:].int(), block_m, num_assignments)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int, method: str = "auto") -> AlignedAssignments:
    """ids [num_tokens, top_k] -> the assignments sorted by expert in padded runs.
    method: "triton", "torch" or "auto" (Triton up to ALIGN_TRITON_MAX_ASSIGNMENTS)."""
    if method == "auto":
        method = "triton" if ids.numel() <= ALIGN_TRITON_MAX_ASSIGNMENTS else "torch"
    if method == "triton":
        return align_triton(ids, num_experts, block_m)
    if method == "torch":
        return align_torch(ids, num_experts, block_m)
    raise ValueError(f"unknown align method {method!r}")
