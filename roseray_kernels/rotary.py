"""Rotary embedding (neox style) of q and k in place, with Qwen3's per-head q/k RMSNorm
optionally fused in front: one launch per layer instead of the gather of cos/sin, the two
norms and the chunk/multiply/cat of each rotation.

One program per token rotates all of its query heads and key heads. cos|sin come straight
from the fp32 table `cos_sin_cache[position]` (cos in the first half of a row, sin in the
second), so nothing is gathered or cast per step. With the norm, rounding follows the torch
path (norm output rounded to the activation dtype); the rotation itself runs in fp32 and is
rounded once, which in bf16 is a little more accurate than the torch expression.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's first head; heads follow each other every HEAD_DIM elements
    cos, sin,  # [BLOCK_HALF] fp32
    weight_ptr,  # [HEAD_DIM] norm weight (unused without QK_NORM)
    eps,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    mask = (heads < NUM_HEADS)[:, None] & d_ok[None, :]
    ptrs = base_ptr + heads[:, None] * HEAD_DIM + d[None, :]  # first halves [BLOCK_HEADS, BLOCK_HALF]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x1f = ((x1f * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2f = ((x2f * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    c, s = cos[None, :], sin[None, :]
    tl.store(ptrs, (x1f * c - x2f * s).to(dtype), mask=mask)
    tl.store(ptrs + HALF, (x2f * c + x1f * s).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr,  # [num_tokens, num_heads | num_kv_heads, HEAD_DIM], token strides below
    positions_ptr,  # [num_tokens] int32/int64
    cos_sin_ptr,  # [max_position, HEAD_DIM] fp32: cos | sin
    q_weight_ptr, k_weight_ptr,  # [HEAD_DIM] each (QK_NORM)
    stride_q, stride_k, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + position * HEAD_DIM + d, mask=d < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * HEAD_DIM + HALF + d, mask=d < HALF, other=0.0)
    _rotate_heads(q_ptr + token * stride_q, cos, sin, q_weight_ptr, eps,
                  NUM_Q_HEADS, HEAD_DIM, HALF, BLOCK_Q_HEADS, BLOCK_HALF, QK_NORM)
    _rotate_heads(k_ptr + token * stride_k, cos, sin, k_weight_ptr, eps,
                  NUM_K_HEADS, HEAD_DIM, HALF, BLOCK_K_HEADS, BLOCK_HALF, QK_NORM)


def rotary_qk_(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], modified in place (a view of qkv is fine)
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], modified in place
    positions: torch.Tensor,  # [num_tokens]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]: RMSNorm each head first (Qwen3)
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """Rotate q and k by their tokens' positions, in place; with norm weights, RMSNorm each head first."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0, (q.shape, k.shape)
    for t in (q, k):  # each token's heads must be one contiguous row
        assert t.stride(2) == 1 and t.stride(1) == head_dim, t.stride()
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
    assert cos_sin_cache.shape[1] == head_dim, (cos_sin_cache.shape, head_dim)
    qk_norm = q_norm_weight is not None
    assert qk_norm == (k_norm_weight is not None)
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_q, block_k = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    num_warps = 4 if (block_q + block_k) * head_dim <= 4096 else 8
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q_norm_weight if qk_norm else q, k_norm_weight if qk_norm else k,
        q.stride(0), k.stride(0), eps,
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
        BLOCK_Q_HEADS=block_q, BLOCK_K_HEADS=block_k, BLOCK_HALF=triton.next_power_of_2(half),
        QK_NORM=qk_norm, num_warps=num_warps,
    )


def rotary_qk_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (new tensors): per-head RMSNorm like HF, then the neox rotation in fp32."""
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(1).chunk(2, dim=-1)  # each [num_tokens, 1, half]

    def one(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is not None:
            xf = x.float()
            normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
            x = (weight * normed).to(x.dtype)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return one(q, q_norm_weight), one(k, k_norm_weight)
