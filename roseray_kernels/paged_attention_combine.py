"""The combine step of split-KV paged attention (launched by roseray_kernels.paged_attention).

A split-KV launch (decode, or the general kernel on a small grid) leaves, for every query row
and head, one partial result per KV split in a workspace: the split's unnormalized accumulator
acc_s [D] and its running max m_s and sum l_s (log2 units, over the keys of that split only).
Index of a partial: (unit * num_heads + head) * NUM_SPLITS + split, where the unit is the
sequence for decode (one query row each) and the token row for the general kernel. A split
that saw no keys left (m, l, acc) = (-1e30, 0, 0) and so weighs nothing here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .paged_attention_kernels import LOG2E


@triton.jit(do_not_specialize=["num_seqs"])
def combine_splits_kernel(
    out_ptr, qsl_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, num_seqs, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
    PER_TOKEN: tl.constexpr,  # False: one program per (sequence, head); True: per (token row, head)
):
    """out[row, head] = sum_s w_s acc_s / (sum_s w_s l_s [+ w_sink]), w_s = 2^(m_s - max m):
    the sink, when there is one, counted here once for all the splits. Rows of sequences with
    no query rows (decode) and rows past query_start_loc[num_seqs] (general) are left alone."""
    unit = tl.program_id(0)
    head = tl.program_id(1)
    if PER_TOKEN:
        q_row = unit
        if q_row >= tl.load(qsl_ptr + num_seqs):
            return
    else:
        q_row = tl.load(qsl_ptr + unit)
        if tl.load(qsl_ptr + unit + 1) - q_row == 0:
            return
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    part = (unit.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits  # [SPLITS]
    m = tl.load(part_ml_ptr + part * 2)
    l = tl.load(part_ml_ptr + part * 2 + 1)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :])  # [SPLITS, D]
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_max = tl.maximum(tl.max(m, 0), sink)
        w = tl.exp2(m - m_max)
        denom = tl.sum(w * l, 0) + tl.exp2(sink - m_max)
    else:
        w = tl.exp2(m - tl.max(m, 0))
        denom = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom == 0.0, 1.0, denom)  # [D]
    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))
