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

Two implementations with equal results (the same bits: both keep the assignment order within an
expert, so the GEMMs and the combine see the same rows in the same places on every run):
- Triton (`align_triton`): a parallel counting sort over chunks of CHUNK assignments in two
  launches, one for a single-chunk step (up to MIN_CHUNK assignments: decode).
  (1) `_count_kernel`, a grid over chunks: each chunk's histogram of experts.
  (2) `_place_kernel`, a grid over chunks and over groups of blocks. Every program sums the chunk
  histograms itself (a few KiB from L2, cheaper than a launch that scans once): each expert's
  total, hence its padded run's start (a prefix sum over experts) and the padded count, and the
  expert's assignments in the chunks before its own. A chunk's program sorts its (expert,
  position) keys in registers and stores each assignment at its expert's run start + the
  expert's assignments in earlier chunks + its rank within the chunk. A program's group of
  blocks gets their experts and their padding rows. No atomics and no memsets: every output
  element is written exactly once.
- torch ops (`align_torch`): a stable sort and scatters; the reference the tests compare to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MIN_CHUNK = 512  # assignments per chunk at least: a step up to here is one chunk, one launch
MAX_CHUNK = 2048  # and at most (the in-register sort of a chunk grows as CHUNK log^2 CHUNK)
TARGET_CHUNKS = 128  # about one chunk per SM for large steps
SCAN_ROWS = 64  # chunk histograms per loop step of a program's scan
BLOCKS_PER_PROGRAM = 32  # blocks of block_m rows whose expert and padding one program writes
HISTOGRAM_MIN_BINS = 32  # experts are counted in at least a warp's width of bins (the extra ones stay empty)


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


def chunk_size(num_assignments: int) -> int:
    """Assignments per chunk: a power of two, so that about TARGET_CHUNKS chunks cover the step."""
    return min(max(triton.next_power_of_2(triton.cdiv(num_assignments, TARGET_CHUNKS)), MIN_CHUNK), MAX_CHUNK)


@triton.jit
def _count_kernel(ids_ptr, chunk_counts_ptr, num_assignments, EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr):
    """chunk_counts[c, e] = the assignments of chunk c that chose expert e."""
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < num_assignments
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    counts = tl.histogram(ids, EXPERTS_P2, mask=valid)
    tl.store(chunk_counts_ptr + chunk * EXPERTS_P2 + tl.arange(0, EXPERTS_P2), counts.to(tl.int32))


@triton.jit
def _place_kernel(
    ids_ptr, chunk_counts_ptr,  # in (chunk_counts: [num_chunks, EXPERTS_P2], unread when ONE_CHUNK)
    sorted_ptr, block_expert_ptr, padded_ptr,  # out
    num_assignments, num_experts, num_chunks, num_blocks,
    BLOCK_M: tl.constexpr, EXPERTS_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCKS: tl.constexpr,
    ROWS: tl.constexpr, ONE_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_P2)
    # each program scans the chunk counts itself (a few KiB from L2) rather than a launch doing it once:
    # every expert's total, and the assignments of each expert in the chunks before this program's
    if ONE_CHUNK:
        step = tl.arange(0, CHUNK)
        in_step = step < num_assignments
        step_ids = tl.load(ids_ptr + step, mask=in_step, other=0).to(tl.int32)
        totals = tl.histogram(step_ids, EXPERTS_P2, mask=in_step).to(tl.int32)
        before = tl.zeros([EXPERTS_P2], dtype=tl.int32)
        own = totals
    else:
        totals = tl.zeros([EXPERTS_P2], dtype=tl.int32)
        before = tl.zeros([EXPERTS_P2], dtype=tl.int32)
        for first in range(0, num_chunks, ROWS):
            chunk = first + tl.arange(0, ROWS)
            counts = tl.load(chunk_counts_ptr + chunk[:, None] * EXPERTS_P2 + experts[None, :],
                             mask=(chunk < num_chunks)[:, None], other=0)
            totals += tl.sum(counts, axis=0)
            before += tl.sum(tl.where((chunk < pid)[:, None], counts, 0), axis=0)
        # this program's chunk (a block-only program reads the last one and leaves it unused)
        own = tl.load(chunk_counts_ptr + tl.minimum(pid, num_chunks - 1) * EXPERTS_P2 + experts)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(padded_ptr, tl.sum(padded, axis=0), mask=pid == 0)

    if pid < num_chunks:
        # the chunk's keys sorted by (expert, position): an assignment's row is its expert's run start,
        # plus the expert's assignments in earlier chunks, plus its position among the sorted keys less
        # the chunk's assignments of smaller experts (all before it in the sorted keys)
        lanes = tl.arange(0, CHUNK)
        offs = pid * CHUNK + lanes
        ids = tl.load(ids_ptr + offs, mask=offs < num_assignments, other=EXPERTS_P2).to(tl.int32)
        keys = tl.sort(ids * CHUNK + lanes)  # missing lanes last
        expert = keys // CHUNK
        base = starts + before - (tl.cumsum(own, axis=0) - own)
        dest = tl.gather(base, tl.minimum(expert, EXPERTS_P2 - 1), axis=0) + lanes
        tl.store(sorted_ptr + dest, pid * CHUNK + keys % CHUNK, mask=expert < EXPERTS_P2)

    # blocks: block b holds rows from b * BLOCK_M; its expert is the number of runs ending at or
    # before it (EXPERTS_P2 past the padded count). Rows of a run past its expert's count are
    # padding, and so are all rows past the padded count; the chunks write the others.
    blocks = pid * BLOCKS + tl.arange(0, BLOCKS)
    in_range = blocks < num_blocks
    block_expert = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + blocks, tl.minimum(block_expert, num_experts - 1), mask=in_range)
    used = block_expert < EXPERTS_P2
    index = tl.minimum(block_expert, EXPERTS_P2 - 1)
    run_start = tl.where(used, tl.gather(starts, index, axis=0), 0)
    run_count = tl.where(used, tl.gather(totals, index, axis=0), 0)
    rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [BLOCKS, BLOCK_M]
    is_padding = rows - run_start[:, None] >= run_count[:, None]
    tl.store(sorted_ptr + rows, tl.zeros([BLOCKS, BLOCK_M], dtype=tl.int32) + num_assignments,
             mask=is_padding & in_range[:, None])


def align_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedAssignments:
    flat = ids.reshape(-1)
    num_assignments, device = flat.numel(), flat.device
    blocks = max_blocks(num_assignments, num_experts, block_m)
    experts_p2 = max(triton.next_power_of_2(num_experts), HISTOGRAM_MIN_BINS)
    chunk = chunk_size(num_assignments)
    num_chunks = triton.cdiv(num_assignments, chunk)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    padded_count = torch.empty(1, dtype=torch.int32, device=device)
    if num_assignments == 0:
        padded_count.zero_()
        return AlignedAssignments(sorted_ids, block_expert, padded_count, block_m, num_assignments)
    one_chunk = num_chunks == 1
    chunk_counts = padded_count  # a dummy: the one chunk is counted where it is placed
    if not one_chunk:
        chunk_counts = torch.empty(num_chunks * experts_p2, dtype=torch.int32, device=device)
        _count_kernel[(num_chunks,)](flat, chunk_counts, num_assignments, EXPERTS_P2=experts_p2, CHUNK=chunk,
                                     num_warps=4)
    grid = max(num_chunks, triton.cdiv(blocks, BLOCKS_PER_PROGRAM))
    _place_kernel[(grid,)](flat, chunk_counts, sorted_ids, block_expert, padded_count, num_assignments,
                           num_experts, num_chunks, blocks, BLOCK_M=block_m, EXPERTS_P2=experts_p2, CHUNK=chunk,
                           BLOCKS=BLOCKS_PER_PROGRAM, ROWS=SCAN_ROWS, ONE_CHUNK=one_chunk, num_warps=4)
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
    method: "triton" (the parallel counting sort; "auto" takes it at every size) or "torch"."""
    if method in ("auto", "triton"):
        return align_triton(ids, num_experts, block_m)
    if method == "torch":
        return align_torch(ids, num_experts, block_m)
    raise ValueError(f"unknown align method {method!r}")
