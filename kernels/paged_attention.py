"""Paged attention through block tables: prefill chunks (cached prefix + causal part) and decode.

The layer appends the step's K/V to the cache first, so every key a query may see is read
from the cache through its sequence's block table. Sequence i owns query rows
`query_start_loc[i] : query_start_loc[i + 1]`, the last `query_len` of its `seq_lens[i]`
tokens. GQA: the query heads that share one KV head are packed into the rows of one
tile, so each K/V tile is read once per KV head. Softmax runs online in fp32 (base 2).

Two launch shapes, both CUDA-graph capturable (grids from shapes and python ints only;
lengths read from device memory; no host syncs):
- decode (`max_query_len == 1`): one program per (sequence, KV head, KV split). With more
  than one split (flash-decoding, for few sequences with long contexts) the partial
  results go to a workspace and a second small kernel combines them. GQA groups use tl.dot
  on tiles of >= 16 rows (the group's heads packed); MHA (GPT-2) would fill one of those 16
  rows and pay the tile's shared memory for nothing, so a group of one takes a dot-free form:
  q.k and p.v summed in the registers of the K/V tiles.
- general (prefill and mixed batches): one program per (query tile, KV head); a tile is
  BLOCK_Q tokens of one sequence, found by binary search over query_start_loc.

Padding: sequences with seq_len 0 give zero rows; rows past query_start_loc[-1] are zeroed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max, so no inf - inf


@dataclass(frozen=True)
class KernelConfig:
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    block_m: int = 16  # query rows per tile (general kernel: tokens x packed heads)
    use_dot: bool = True  # decode: tl.dot on >= 16-row tiles; False = dot-free rows in registers


# Tile shapes chosen from `python -m roseray.bench kernels --sweep` on an H100 (BENCHMARKS.md,
# "Kernel tile choices"): decode tiles of 32-128 keys with 2-4 warps are equivalent, 8 warps slower;
# 64x64 prefill tiles are near the best shape tried.
DECODE_CONFIG = KernelConfig(block_n=64, num_warps=4, num_stages=3)
# MHA decode (group of one, e.g. GPT-2's 12 heads of 64) runs without tl.dot: 32 keys x 2 warps.
DECODE_MHA_CONFIG = KernelConfig(block_n=32, num_warps=2, num_stages=1, use_dot=False)
PREFILL_CONFIG = KernelConfig(block_n=64, num_warps=4, num_stages=2, block_m=64)
# Split-KV pays off only for small grids over long contexts (one long sequence); a full batch is
# already enough programs and gets slower when split.
MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256


# ---------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------
@triton.jit
def _attend(
    acc, m_i, l_i,  # running state: [M, D] fp32, [M] fp32, [M] fp32
    q,  # [M, D] query rows, in the cache dtype
    k_head_ptr, v_head_ptr,  # cache base pointers already offset to this KV head
    table_ptr,  # this sequence's block-table row
    kv_lo, kv_hi,  # key positions [kv_lo, kv_hi) to visit
    q_pos,  # [M] position of each row's query (used when CAUSAL)
    qk_scale,  # softmax scale * log2(e)
    stride_kb, stride_ks,  # cache strides of a block and of a slot
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax of q against keys [kv_lo, kv_hi) of one sequence and one KV head."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [N] key positions
        valid_n = offs_n < kv_hi
        page = tl.load(table_ptr + offs_n // PAGE, mask=valid_n, other=0).to(tl.int64)
        kv_off = page * stride_kb + (offs_n % PAGE) * stride_ks  # [N]
        kv_ptrs = kv_off[:, None] + offs_d[None, :]  # [N, D]
        k = tl.load(k_head_ptr + kv_ptrs, mask=valid_n[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        keep = valid_n[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= q_pos[:, None])
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head_ptr + kv_ptrs, mask=valid_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_row(
    q,  # [1, D] the query row of a group of one (MHA), fp32
    k_head_ptr, v_head_ptr, table_ptr, kv_lo, kv_hi, qk_scale, stride_kb, stride_ks,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """_attend for one query row without tl.dot: q.k and p.v are products summed in the
    registers of the [N, D] K/V tiles (no 16-row tile, no shared-memory staging). Each step
    loads K and V together and the next step's block-table entries ahead, so a step waits
    for one memory round trip. Returns acc [1, D], m_i [1], l_i [1] like _attend."""
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    m_i = tl.full([], NEG_BIG, tl.float32)  # running max and sum: fp32 scalars
    l_i = tl.zeros([], tl.float32)
    offs_n = kv_lo + tl.arange(0, BLOCK_N)  # [N] key positions of the first step
    page = tl.load(table_ptr + offs_n // PAGE, mask=offs_n < kv_hi, other=0)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid_n = offs_n < kv_hi
        kv_ptrs = (page.to(tl.int64) * stride_kb + (offs_n % PAGE) * stride_ks)[:, None] + offs_d[None, :]  # [N, D]
        k = tl.load(k_head_ptr + kv_ptrs, mask=valid_n[:, None], other=0.0)
        v = tl.load(v_head_ptr + kv_ptrs, mask=valid_n[:, None], other=0.0)
        next_n = offs_n + BLOCK_N
        page = tl.load(table_ptr + next_n // PAGE, mask=next_n < kv_hi, other=0)
        qk = tl.sum(q * k.to(tl.float32), 1) * qk_scale  # [N]
        qk = tl.where(valid_n, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new)  # [N]
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)  # [D]
        m_i = m_new
    one = tl.zeros([1], tl.float32)
    return acc[None, :], one + m_i, one + l_i


@triton.jit
def _zero_rows(out_ptr, rows, num_tokens, head0, stride_ot, stride_oh,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Store zeros to out[rows, head0 : head0 + GROUP] for rows < num_tokens (rows [M] as packed in a tile)."""
    r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = head0 + r % GROUP_PAD
    ok = (rows < num_tokens) & (r % GROUP_PAD < GROUP)
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(ptrs, tl.zeros([BLOCK_M, HEAD_DIM], out_ptr.dtype.element_ty), mask=ok[:, None])


# ---------------------------------------------------------------------------------------
# Decode: one program per (sequence, KV head, split)
# ---------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_table"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, tables_ptr,
    part_acc_ptr, part_ml_ptr,  # split workspace: [S, H, SPLITS, D] fp32, [S, H, SPLITS, 2] fp32
    qk_scale, num_seqs, num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_kb, stride_ks, stride_kh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr,  # False: _attend_row (GROUP == 1, BLOCK_M == 1)
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.arange(0, BLOCK_M)  # packed rows: query head kv_head * GROUP + r
    head_ok = r < GROUP
    offs_d = tl.arange(0, HEAD_DIM)

    # Rows past the last sequence's query rows (padding tokens) are zeroed, one per program.
    if split == 0:
        pad_row = tl.load(qsl_ptr + num_seqs) + pid
        _zero_rows(out_ptr, pad_row + r * 0, num_tokens, kv_head * GROUP, stride_ot, stride_oh,
                   GROUP, BLOCK_M, BLOCK_M, HEAD_DIM)
    if pid >= num_seqs:
        return
    q_row = tl.load(qsl_ptr + pid)
    if tl.load(qsl_ptr + pid + 1) - q_row == 0:
        return
    seq_len = tl.load(seq_lens_ptr + pid)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, seq_len)

    q_rows = q_row.to(tl.int64) * stride_qt + (kv_head * GROUP + r) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=head_ok[:, None], other=0.0)  # [M, D]
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_kh
    table_ptr = tables_ptr + pid.to(tl.int64) * stride_table
    if USE_DOT:
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_ptr, kv_lo, kv_hi, r, qk_scale,
                                stride_kb, stride_ks, PAGE, BLOCK_N, HEAD_DIM, False, DOT_PRECISION)
    else:
        acc, m_i, l_i = _attend_row(q.to(tl.float32), k_head_ptr, v_head_ptr, table_ptr, kv_lo, kv_hi, qk_scale,
                                    stride_kb, stride_ks, PAGE, BLOCK_N, HEAD_DIM)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = q_row.to(tl.int64) * stride_ot + (kv_head * GROUP + r) * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        heads = kv_head * GROUP + r  # [M]
        part = (pid.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split  # [M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=head_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_ok)


@triton.jit
def _combine_splits_kernel(
    out_ptr, qsl_ptr, part_acc_ptr, part_ml_ptr, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """out[row(seq), head] = sum_s w_s acc_s / sum_s w_s l_s, w_s = 2^(m_s - max m)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_row == 0:
        return
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits  # [SPLITS]
    m = tl.load(part_ml_ptr + part * 2)
    l = tl.load(part_ml_ptr + part * 2 + 1)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :])  # [SPLITS, D]
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom == 0.0, 1.0, denom)  # [D]
    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------
# General: one program per (query tile of one sequence, KV head)
# ---------------------------------------------------------------------------------------
@triton.jit
def _tile_start(qsl_ptr, seq, BLOCK_Q: tl.constexpr):
    """First tile index of sequence `seq`: strictly increasing in seq, and each sequence
    gets at least cdiv(query_len, BLOCK_Q) tiles before the next one starts."""
    return tl.load(qsl_ptr + seq) // BLOCK_Q + seq


@triton.jit
def _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest seq in [0, num_seqs] with _tile_start(seq) <= tile (binary search)."""
    lo = num_seqs * 0
    hi = num_seqs + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = _tile_start(qsl_ptr, mid, BLOCK_Q) <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_table"])
def _general_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, tables_ptr,
    qk_scale, num_seqs, num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_kb, stride_ks, stride_kh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    tok = r // GROUP_PAD  # token of the row within the tile
    head = kv_head * GROUP + r % GROUP_PAD
    head_ok = r % GROUP_PAD < GROUP
    offs_d = tl.arange(0, HEAD_DIM)

    seq = _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + seq)
    first = (tile - _tile_start(qsl_ptr, seq, BLOCK_Q)) * BLOCK_Q  # first query row of the tile in seq
    if seq == num_seqs:  # past the last sequence: zero the padding rows
        rows = q_begin + first + tok
        _zero_rows(out_ptr, rows, num_tokens, kv_head * GROUP, stride_ot, stride_oh,
                   GROUP, GROUP_PAD, BLOCK_M, HEAD_DIM)
        return
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    row_ok = (first + tok < q_len) & head_ok
    rows = (q_begin + first + tok).to(tl.int64)
    q_pos = seq_len - q_len + first + tok  # [M]
    q = tl.load(q_ptr + (rows * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_kh
    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table
    # Keys before the tile's first query are visible to every row; the rest needs the causal mask.
    kv_shared = tl.maximum(seq_len - q_len + first, 0)
    kv_end = tl.minimum(seq_len, seq_len - q_len + first + BLOCK_Q)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_ptr, 0, kv_shared, q_pos,
                            qk_scale, stride_kb, stride_ks, PAGE, BLOCK_N, HEAD_DIM, False, DOT_PRECISION)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_ptr, kv_shared, kv_end, q_pos,
                            qk_scale, stride_kb, stride_ks, PAGE, BLOCK_N, HEAD_DIM, True, DOT_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + (rows * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------
@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """KV splits for decode: enough programs to fill the GPU twice, at least
    MIN_TOKENS_PER_SPLIT keys each; a power of two (few compiled variants)."""
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= target or max_seq_len <= MIN_TOKENS_PER_SPLIT:
        return 1
    splits = min(triton.cdiv(target, programs), triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT))
    return min(triton.next_power_of_2(splits), MAX_SPLITS)


def _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, query.shape)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K and V caches must share a layout"
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert query.dtype == k_cache.dtype == v_cache.dtype, (query.dtype, k_cache.dtype)
    assert query.stride(2) == 1, "query rows must be contiguous in head_dim"
    assert query_start_loc.dtype == seq_lens.dtype == block_tables.dtype == torch.int32
    assert query_start_loc.shape[0] >= seq_lens.shape[0] + 1 and block_tables.shape[0] >= seq_lens.shape[0]
    assert block_tables.stride(1) == 1


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached tokens incl. this step's
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,  # host hint only (sizes split-KV); may be the model's max length
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,  # decode KV splits; None = choose from the shapes
) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its cached keys."""
    _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if out is None:
        out = torch.empty_like(query)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return out
    if max_query_len <= 1:
        if num_splits is None:
            num_splits = choose_num_splits(seq_lens.shape[0], k_cache.shape[2], max_seq_len, query.device)
        cfg = DECODE_MHA_CONFIG if _group(query, k_cache)[0] == 1 else DECODE_CONFIG
        _launch_decode(query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                       num_splits, cfg)
    else:
        _launch_general(query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                        PREFILL_CONFIG)
    return out


def _common_args(query, k_cache, out, block_tables, scale):
    return (scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))


def _group(query, k_cache) -> tuple[int, int]:
    group = query.shape[1] // k_cache.shape[2]
    return group, triton.next_power_of_2(group)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_decode(query, k_cache, v_cache, out, qsl, seq_lens, tables, scale, num_splits, cfg: KernelConfig):
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    group, group_pad = _group(query, k_cache)
    assert cfg.use_dot or group == 1, "the dot-free decode takes one query head per KV head"
    if num_splits > 1:
        assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    scale_l2, sqt, sqh, sot, soh, stab, skb, sks, skh = _common_args(query, k_cache, out, tables, scale)
    grid = (max(num_seqs, num_tokens), num_kv_heads, num_splits)
    _decode_kernel[grid](
        query, k_cache, v_cache, out, qsl, seq_lens, tables, part_acc, part_ml,
        scale_l2, num_seqs, num_tokens, sqt, sqh, sot, soh, stab, skb, sks, skh,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=max(16, group_pad) if cfg.use_dot else 1,
        HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(query.dtype), USE_DOT=cfg.use_dot,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1 and num_seqs > 0:
        _combine_splits_kernel[(num_seqs, num_heads)](
            out, qsl, part_acc, part_ml, num_heads, sot, soh, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, num_warps=4,
        )


def _launch_general(query, k_cache, v_cache, out, qsl, seq_lens, tables, scale, cfg: KernelConfig):
    num_tokens, _, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    group, group_pad = _group(query, k_cache)
    block_q = max(1, cfg.block_m // group_pad)
    block_q = max(block_q, triton.cdiv(16, group_pad))  # tl.dot needs >= 16 rows
    scale_l2, sqt, sqh, sot, soh, stab, skb, sks, skh = _common_args(query, k_cache, out, tables, scale)
    grid = (num_tokens // block_q + num_seqs + 1, num_kv_heads)
    _general_kernel[grid](
        query, k_cache, v_cache, out, qsl, seq_lens, tables,
        scale_l2, num_seqs, num_tokens, sqt, sqh, sot, soh, stab, skb, sks, skh,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_N=cfg.block_n, DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
