"""The jitted kernels of paged attention (launched by roseray_kernels.paged_attention): decode
and general, each with an optional KV split (NUM_SPLITS > 1: partials for the combine kernel in
paged_attention_combine; NUM_SPLITS == 1 compiles to the single-pass kernel).

Scores are kept in log2 units (the host folds log2(e) into the scale) so the online
softmax runs on exp2. The layer options are constexpr flags, so a layer without them
compiles to exactly the plain kernel:
- HAS_WINDOW: a query at position p sees keys in (p - window, p]; the KV loop starts at the
  cache block holding the first key inside the window of the tile's earliest query, so
  blocks wholly outside the window are never read, and keys before the window in that
  first block are masked.
- HAS_SOFTCAP: scores s (after the softmax scale) -> cap * tanh(s / cap). The host passes
  qk_scale = scale / cap and cap_l2 = cap * log2(e): tanh sees s / cap, and its result
  lands in log2 units.
- HAS_SINKS: one extra logit per query head in every softmax's denominator, attending to
  nothing. It is folded in once, after the online softmax (`_add_sink`); with split-KV,
  in the combine kernel only.
- KV_FP8: the cache holds e4m3 values; K/V tiles are converted to the query's dtype after
  the load (the dots run as in the plain kernel). The host folds k_scale into qk_scale; the
  output (or, with split-KV, each split's accumulator) is multiplied by v_scale once.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max, so no inf - inf


# ---------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """tanh from exp2 (1 - 2 / (e^2x + 1)): saturates to +-1 without inf / inf."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _window_start(first_q_pos, window, PAGE: tl.constexpr):
    """First key position to visit for queries from `first_q_pos` on: the start of the cache
    block that holds the first key inside the earliest query's window."""
    return tl.maximum(first_q_pos - window + 1, 0) // PAGE * PAGE


@triton.jit
def _add_sink(acc, m_i, l_i, sink):
    """Fold a sink logit (log2 units, [M]) into the running state; returns acc and l_i
    rescaled to the new maximum (acc / l_i is then the output)."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_new)


@triton.jit
def _attend(
    acc, m_i, l_i,  # running state: [M, D] fp32, [M] fp32, [M] fp32
    q,  # [M, D] query rows, in the cache dtype
    k_head_ptr, v_head_ptr,  # cache base pointers already offset to this KV head
    table_ptr,  # this sequence's block-table row
    kv_lo, kv_hi,  # key positions [kv_lo, kv_hi) to visit
    q_pos,  # [M] position of each row's query (used when CAUSAL or HAS_WINDOW)
    qk_scale, window, cap_l2,  # see the module docstring
    stride_kb, stride_ks,  # cache strides of a block and of a slot
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
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
        if KV_FP8:
            k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        if HAS_SOFTCAP:
            qk = _tanh(qk) * cap_l2
        keep = valid_n[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            keep = keep & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head_ptr + kv_ptrs, mask=valid_n[:, None], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_row(
    q,  # [1, D] the query row of a group of one (MHA), fp32
    k_head_ptr, v_head_ptr, table_ptr, kv_lo, kv_hi,
    q_pos,  # the query's position (used when HAS_WINDOW)
    qk_scale, window, cap_l2, stride_kb, stride_ks,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
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
        if HAS_SOFTCAP:
            qk = _tanh(qk) * cap_l2
        keep = valid_n
        if HAS_WINDOW:
            keep = keep & (offs_n > q_pos - window)
        qk = tl.where(keep, qk, float("-inf"))
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
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_table", "window"])
def decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, tables_ptr,
    part_acc_ptr, part_ml_ptr,  # split workspace: [S, H, SPLITS, D] fp32, [S, H, SPLITS, 2] fp32
    sinks_ptr,  # [H] sink logits (HAS_SINKS)
    qk_scale, window, cap_l2, v_scale, num_seqs, num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_kb, stride_ks, stride_kh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr,  # False: _attend_row (GROUP == 1, BLOCK_M == 1)
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
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
    q_pos = seq_len - 1
    seq_lo = seq_len * 0  # the splits share [seq_lo, seq_len): the window's blocks only
    if HAS_WINDOW:
        seq_lo = _window_start(q_pos, window, PAGE)
    chunk = tl.cdiv(tl.cdiv(seq_len - seq_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = seq_lo + split * chunk
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
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_ptr, kv_lo, kv_hi, q_pos + r * 0,
                                qk_scale, window, cap_l2, stride_kb, stride_ks, PAGE, BLOCK_N, HEAD_DIM, False,
                                DOT_PRECISION, HAS_WINDOW, HAS_SOFTCAP, KV_FP8)
    else:
        acc, m_i, l_i = _attend_row(q.to(tl.float32), k_head_ptr, v_head_ptr, table_ptr, kv_lo, kv_hi, q_pos,
                                    qk_scale, window, cap_l2, stride_kb, stride_ks, PAGE, BLOCK_N, HEAD_DIM,
                                    HAS_WINDOW, HAS_SOFTCAP)
    heads = kv_head * GROUP + r  # [M]
    if KV_FP8:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * LOG2E
            acc, l_i = _add_sink(acc, m_i, l_i, sink)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = q_row.to(tl.int64) * stride_ot + heads * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        part = (pid.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split  # [M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=head_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=head_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=head_ok)


# ---------------------------------------------------------------------------------------
# General: one program per (query tile of one sequence, KV head, split)
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


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_table", "window"])
def general_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, tables_ptr,
    part_acc_ptr, part_ml_ptr,  # split workspace (NUM_SPLITS > 1): [T, H, SPLITS, D] fp32, [T, H, SPLITS, 2] fp32
    sinks_ptr,  # [H] sink logits (HAS_SINKS)
    qk_scale, window, cap_l2, v_scale, num_seqs, num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_kb, stride_ks, stride_kh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
):
    """With NUM_SPLITS == 1 a program walks its tile's whole key range and writes the output.
    With more, split s of a tile walks the s-th BLOCK_N-aligned part of that range (computed
    here from the sequence's length, so any lengths fit one compiled split count) and leaves
    its partial (acc, m, l) per row and head for combine_splits_kernel; the sink is left to
    the combine."""
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
        if NUM_SPLITS > 1:  # split 0 writes them (rows >= num_tokens are not stored)
            rows = tl.where(tl.program_id(2) == 0, rows, num_tokens)
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
    # Keys before the tile's first query are visible to every row (within the window); the rest
    # needs the causal mask. This program visits [kv_start, shared_end) unmasked and
    # [causal_start, kv_end) masked.
    kv_shared = tl.maximum(seq_len - q_len + first, 0)
    kv_end = tl.minimum(seq_len, seq_len - q_len + first + BLOCK_Q)
    kv_start = kv_shared * 0
    if HAS_WINDOW:
        kv_start = _window_start(kv_shared, window, PAGE)
    shared_end = kv_shared
    causal_start = kv_shared
    if NUM_SPLITS > 1:  # this split's part of [kv_start, kv_end), whole BLOCK_N steps but the last
        chunk = tl.cdiv(tl.cdiv(tl.maximum(kv_end - kv_start, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = kv_start + tl.program_id(2) * chunk
        kv_end = tl.minimum(kv_start + chunk, kv_end)
        shared_end = tl.minimum(kv_end, kv_shared)
        causal_start = tl.maximum(kv_start, kv_shared)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_ptr, kv_start, shared_end, q_pos,
                            qk_scale, window, cap_l2, stride_kb, stride_ks, PAGE, BLOCK_N, HEAD_DIM, False,
                            DOT_PRECISION, HAS_WINDOW, HAS_SOFTCAP, KV_FP8)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, table_ptr, causal_start, kv_end, q_pos,
                            qk_scale, window, cap_l2, stride_kb, stride_ks, PAGE, BLOCK_N, HEAD_DIM, True,
                            DOT_PRECISION, HAS_WINDOW, HAS_SOFTCAP, KV_FP8)
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=head_ok, other=0.0).to(tl.float32) * LOG2E
            acc, l_i = _add_sink(acc, m_i, l_i, sink)
        if KV_FP8:
            acc = acc * v_scale
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + (rows * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        if KV_FP8:
            acc = acc * v_scale
        part = (rows * (tl.num_programs(1) * GROUP) + head) * NUM_SPLITS + tl.program_id(2)  # [M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
