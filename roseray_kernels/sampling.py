"""Temperature sampling by Gumbel-max in one pass over the logits: per row,

    token = argmax_v(logits[v] / temperature + G_v),   G_v = -log(-log(U_v)),  U_v ~ Uniform(0, 1)

which draws token v with probability softmax(logits / temperature)[v]. Rows with
temperature 0 take the plain argmax (first index of the maximum, like torch.argmax).

The logits are read once and nothing of size [batch, vocab] is written: the noise comes
from Philox (keyed by a seed read from device memory, counted by column and row), and each
program keeps a running maximum over its slice of the row. Two launches:

1. grid (rows, splits): each program scans `cols_per_program` columns of its row(s) and
   writes the best value and column to a [rows, splits] workspace;
2. grid (rows,): the best of a row's splits (ties: the smallest column).

The seed is read from device memory, so the caller draws it from a torch generator
without a host sync; the same seed and logits give the same tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 2048  # columns per loop step (4 quarters share one Philox call)
NUM_WARPS = 4
TARGET_PROGRAMS = 2048  # enough programs to fill an H100 at small batch sizes
MAX_COLS_PER_PROGRAM = 16 * BLOCK


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _gumbel_max_partial_kernel(
    logits_ptr,  # [num_rows, vocab_size], row stride stride_row, any float dtype
    temperature_ptr,  # [num_rows] fp32; 0 = greedy
    seed_ptr,  # [1] int64: the Philox key
    part_value_ptr,  # [num_rows, num_splits] fp32
    part_index_ptr,  # [num_rows, num_splits] int32
    num_rows,
    vocab_size,
    stride_row,
    cols_per_program,  # a multiple of BLOCK
    num_splits,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program (1 on GPUs; more keeps the CPU interpreter quick)
    FAST_LOG: tl.constexpr,  # the hardware's approximate log2 (not in the CPU interpreter)
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_ok = rows < num_rows
    split = tl.program_id(1)
    col_lo = split * cols_per_program
    col_hi = tl.minimum(col_lo + cols_per_program, vocab_size)
    row_ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_row  # [ROWS, 1]
    temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=0.0)[:, None]  # [ROWS, 1]
    sampled = temperature > 0.0
    inv_temperature = 1.0 / tl.where(sampled, temperature, 1.0)
    key = tl.load(seed_ptr)
    QUARTER: tl.constexpr = BLOCK // 4
    lane = tl.arange(0, QUARTER)[None, :]  # [1, QUARTER]
    zero = tl.zeros([ROWS, QUARTER], dtype=tl.uint32)
    row_counter = rows.to(tl.uint32)[:, None] + zero  # [ROWS, QUARTER]
    best = tl.full([ROWS, QUARTER], float("-inf"), tl.float32)
    best_index = tl.zeros([ROWS, QUARTER], dtype=tl.int32) + col_lo
    for step in range(0, tl.cdiv(col_hi - col_lo, BLOCK)):
        start = tl.multiple_of(col_lo + step * BLOCK, BLOCK)  # aligned: vector loads
        # Counters (start + lane, row) give four uniforms each: one per quarter of the block.
        r0, r1, r2, r3 = tl.philox(key, (start + lane).to(tl.uint32) + zero, row_counter, zero, zero)
        best, best_index = _update(row_ptrs, start + lane, col_hi, row_ok, r0, sampled, inv_temperature,
                                   best, best_index, FAST_LOG)
        best, best_index = _update(row_ptrs, start + QUARTER + lane, col_hi, row_ok, r1, sampled,
                                   inv_temperature, best, best_index, FAST_LOG)
        best, best_index = _update(row_ptrs, start + 2 * QUARTER + lane, col_hi, row_ok, r2, sampled,
                                   inv_temperature, best, best_index, FAST_LOG)
        best, best_index = _update(row_ptrs, start + 3 * QUARTER + lane, col_hi, row_ok, r3, sampled,
                                   inv_temperature, best, best_index, FAST_LOG)
    top = tl.max(best, axis=1)  # [ROWS]
    top_index = tl.min(tl.where(best == top[:, None], best_index, vocab_size), axis=1)
    tl.store(part_value_ptr + rows * num_splits + split, top, mask=row_ok)
    tl.store(part_index_ptr + rows * num_splits + split, top_index, mask=row_ok)


@triton.jit
def _update(row_ptrs, cols, col_hi, row_ok, random_bits, sampled, inv_temperature, best, best_index,
            FAST_LOG: tl.constexpr):
    """Fold one quarter-block of columns [1, QUARTER] into each lane's running best."""
    x = tl.load(row_ptrs + cols, mask=row_ok[:, None] & (cols < col_hi), other=float("-inf")).to(tl.float32)
    u = tl.uint_to_uniform_float(random_bits)  # [0, 1)
    # Gumbel noise -ln(-ln u) through base-2 logs; u = 0 gives -inf: that column cannot win,
    # and no NaN appears.
    exponential = _log2(u, FAST_LOG) * -0.6931471805599453  # -ln(u)
    gumbel = _log2(exponential, FAST_LOG) * -0.6931471805599453
    value = tl.where(sampled, x * inv_temperature + gumbel, x)
    take = value > best  # strict: each lane keeps its first maximum (argmax ties go to the lowest column)
    return tl.where(take, value, best), tl.where(take, cols, best_index)


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    if FAST_LOG:
        y = libdevice.fast_log2f(x)  # lg2.approx: ~2^-22 relative error, plenty for noise
    else:
        y = tl.log2(x)
    return y


@triton.jit(do_not_specialize=["num_rows", "num_splits", "vocab_size"])
def _argmax_splits_kernel(
    part_value_ptr, part_index_ptr,  # [num_rows, num_splits]
    out_ptr,  # [num_rows] int64
    num_rows,
    num_splits,
    vocab_size,
    ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    s = tl.arange(0, BLOCK_S)[None, :]
    ok = row_ok[:, None] & (s < num_splits)
    offsets = rows[:, None] * num_splits + s
    value = tl.load(part_value_ptr + offsets, mask=ok, other=float("-inf"))
    index = tl.load(part_index_ptr + offsets, mask=ok, other=vocab_size)
    top = tl.max(value, axis=1)
    token = tl.min(tl.where(ok & (value == top[:, None]), index, vocab_size), axis=1)
    tl.store(out_ptr + rows, token.to(tl.int64), mask=row_ok)


def split_columns(num_rows: int, vocab_size: int, block: int = BLOCK) -> int:
    """Columns per program: a multiple of `block`, few enough that rows x splits fill the GPU."""
    blocks = triton.cdiv(vocab_size, block)
    splits_wanted = max(1, TARGET_PROGRAMS // max(num_rows, 1))
    blocks_per_program = max(1, min(MAX_COLS_PER_PROGRAM // block, triton.cdiv(blocks, splits_wanted)))
    return blocks_per_program * block


def variant_row_counts(max_rows: int, vocab_size: int) -> list[int]:
    """One row count per compiled variant of the kernels that batches of 1..max_rows rows
    launch on CUDA (the split count's power of two is a compile-time constant): what a
    warm-up must run so that no batch compiles a kernel later."""
    seen: dict[int, int] = {}
    for num_rows in range(1, max_rows + 1):
        num_splits = triton.cdiv(vocab_size, split_columns(num_rows, vocab_size))
        seen.setdefault(triton.next_power_of_2(num_splits), num_rows)
    return sorted(seen.values())


def gumbel_max_sample(
    logits: torch.Tensor,  # [num_rows, vocab_size], unit column stride
    temperatures: torch.Tensor,  # [num_rows] fp32 on the logits' device; 0 = greedy
    seed: torch.Tensor,  # [1] int64 on the logits' device
    block: int | None = None,
    rows_per_program: int | None = None,
) -> torch.Tensor:
    """One token per row, [num_rows] int64: Gumbel-max at each row's temperature, argmax at 0.

    For a given `block` (columns per loop step) the tokens depend on the logits, temperatures
    and seed only, not on how rows and columns are split over programs. Defaults: BLOCK and
    one row per program on CUDA; on CPU, where only the interpreter runs it, one block over
    the (tiny) vocabulary and many rows per program."""
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    assert temperatures.dtype == torch.float32 and temperatures.shape == (logits.shape[0],)
    assert seed.dtype == torch.int64 and seed.numel() == 1
    num_rows, vocab_size = logits.shape
    if block is None:
        block = BLOCK if logits.is_cuda else max(4, min(BLOCK, triton.next_power_of_2(vocab_size)))
    if rows_per_program is None:
        rows_per_program = 1 if logits.is_cuda else min(triton.next_power_of_2(num_rows), max(1, 2**16 // block))
    assert block >= 4 and block & (block - 1) == 0 and rows_per_program & (rows_per_program - 1) == 0
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    cols_per_program = split_columns(triton.cdiv(num_rows, rows_per_program), vocab_size, block)
    num_splits = triton.cdiv(vocab_size, cols_per_program)
    part_value = torch.empty((num_rows, num_splits), dtype=torch.float32, device=logits.device)
    part_index = torch.empty((num_rows, num_splits), dtype=torch.int32, device=logits.device)
    row_programs = triton.cdiv(num_rows, rows_per_program)
    _gumbel_max_partial_kernel[(row_programs, num_splits)](
        logits, temperatures, seed, part_value, part_index, num_rows, vocab_size, logits.stride(0),
        cols_per_program, num_splits, BLOCK=block, ROWS=rows_per_program, FAST_LOG=logits.is_cuda,
        num_warps=NUM_WARPS,
    )
    _argmax_splits_kernel[(row_programs,)](
        part_value, part_index, out, num_rows, num_splits, vocab_size,
        ROWS=rows_per_program, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=1,
    )
    return out


def gumbel_max_reference(logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Torch reference with explicit noise `uniform` [num_rows, vocab_size] in (0, 1)."""
    scaled = logits.float() / temperatures.clamp_min(1e-30).unsqueeze(1) - (-uniform.log()).log()
    return torch.where(temperatures > 0, scaled.argmax(dim=-1), logits.argmax(dim=-1))
