"""FP8 (e4m3) quantization: weights per output channel at load, activations per token per step.

A quantized tensor is `q = clamp(x / scale, -448, 448)` in float8_e4m3fn with `x ~= q * scale`;
the scale of a row is its largest magnitude / 448, so the row's largest value lands on e4m3's
largest finite value and nothing overflows (e4m3fn has no infinity: an out-of-range cast
would be NaN, hence the clamp).

Activations: one program per token row reads the row twice (the largest magnitude, then the
quantized values; the second read comes from L2), so a step's quantization is one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# A row of zeros gets this scale (not 0) so that dequantizing gives zeros, never NaN.
MIN_SCALE = 1e-12
BLOCK_COLS = 1024  # columns per loop iteration of a row


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], fp32 scale [N]): one scale per output channel (row)."""
    w = weight.float()
    # times the reciprocal, not divided by a scalar: CUDA does the latter as the former, so this
    # gives the same scales (and e4m3 values) on every device: a checkpoint written on the CPU
    # equals quantizing at load on the GPU
    scale = (w.abs().amax(dim=1) * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M, 1]), in torch."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, scale_ptr, k_dim, stride_xm, stride_qm,
                            FP8_MAX_VALUE: tl.constexpr, MIN_SCALE_VALUE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    peak = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, k_dim, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < k_dim, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    scale = tl.maximum(tl.max(peak, axis=0) / FP8_MAX_VALUE, MIN_SCALE_VALUE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, k_dim, BLOCK):
        ok = start + cols < k_dim
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX_VALUE), FP8_MAX_VALUE)
        tl.store(q_ptr + row * stride_qm + start + cols, q.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], fp32 scale [M, 1]), one launch."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(BLOCK_COLS, triton.next_power_of_2(k))
        _per_token_quant_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                      FP8_MAX_VALUE=FP8_MAX, MIN_SCALE_VALUE=MIN_SCALE, BLOCK=block,
                                      num_warps=4 if block >= 512 else 1)
    return q, scale
