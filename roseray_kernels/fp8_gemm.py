"""FP8 linear layers: y = x @ (W * scale[:, None]).T + bias, with W e4m3 [N, K], one fp32 scale per
output channel, x and y in the model's dtype.

Two paths, by the number of rows M of x (measured on an H100 at Llama-8B's shapes, one layer's four
projections: `python -m roseray.bench kernels --fp8`):
- M <= W8A16_MAX_ROWS (small decode steps): this module's Triton kernel reads fp8 weight tiles,
  widens them to x's dtype in registers and multiplies on the tensor cores (fp32 accumulation);
  the weight scale (and bias) are applied in the epilogue. x is not quantized: no extra launch,
  and no activation rounding. 1.3-1.4x faster than bf16 at 1-16 rows, where cuBLASLt's row-wise
  fp8 GEMM is no faster than bf16; past 16 rows its bf16 multiplies cost more than they save.
- larger M: x is quantized per token (fp8_quant.quantize_per_token, one launch) and
  `torch._scaled_mm` runs the fp8 tensor-core GEMM with row-wise scales (x's per token, W's per
  channel) in its epilogue: 1.15-1.2x over bf16 at 32-64 rows, 1.3-1.6x from 96 on the H100 with
  slow accumulation; fast accumulation (FAST_ACCUM) takes a further 7-12% off from 256 rows on
  an H200 (140.6 against 150.9 us at 256 rows, 386.8 against 430.4 at 1024).
Both are CUDA-graph capturable (the path is chosen from shapes, never from data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fp8_quant import quantize_per_token

# Rows up to which the weight-streaming kernel runs (above: quantized activations, cuBLASLt).
W8A16_MAX_ROWS = 16
# The fp8 GEMM's accumulation: Hopper's fp8 tensor cores keep fewer bits than fp32 between
# instructions, and torch._scaled_mm by default (slow accumulation) promotes the partial sums to
# fp32 registers at intervals, which costs throughput; fast accumulation leaves them. vLLM's
# CUTLASS fp8 kernels for SM90 (its online fp8, the peer) all use the fast-accumulation schedules.
FAST_ACCUM = True


@dataclass(frozen=True)
class W8A16Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# 16 rows (the smallest tile tl.dot takes) and 32 columns, so that even a 4096-column projection
# gives every SM a program; wide projections (many programs) stream better with shorter k steps
# (the tile sweep of `bench kernels --fp8 --sweep`: gate|up 45.6 us against 59.3 at 1 row).
NARROW_TILE = W8A16Tile(16, 32, 256, 4, 4)
WIDE_TILE = W8A16Tile(16, 32, 128, 4, 3)
WIDE_PROGRAMS_PER_SM = 4
W8A8_TILE = W8A16Tile(64, 128, 128, 8, 3)  # fp8 x fp8: wgmma wants 64-row tiles


def choose_w8a16_tile(rows: int, cols: int, num_sms: int) -> W8A16Tile:
    programs = triton.cdiv(cols, NARROW_TILE.block_n) * triton.cdiv(rows, NARROW_TILE.block_m)
    return WIDE_TILE if programs >= WIDE_PROGRAMS_PER_SM * num_sms else NARROW_TILE


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantized weight in x's dtype times x (the CPU path, and what the kernels are tested on)."""
    w = weight.to(x.dtype) * weight_scale.to(x.dtype)[:, None]
    return torch.nn.functional.linear(x, w, bias)


@triton.jit
def _fp8_gemm_kernel(x_ptr, x_scale_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, m_rows, n_cols, k_dim,
                     stride_xm, stride_wn, stride_om,
                     X_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """out = x @ W.T * scale (* x_scale per row when X_FP8: x quantized, an fp8 x fp8 dot) + bias.
    Programs sharing a weight tile run next to each other (rows fastest), so W is read once."""
    num_m = tl.cdiv(m_rows, BLOCK_M)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < m_rows
    n_ok = offs_n < n_cols
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, N]: W transposed
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, k_dim, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = start + offs_k < k_dim
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if X_FP8:
            acc = tl.dot(a, w, acc)
        else:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if X_FP8:
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch(x, x_scale, weight, weight_scale, bias, out, tile: W8A16Tile) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.is_contiguous(), (x.shape, weight.shape)
    if m == 0:
        return out
    grid = (triton.cdiv(n, tile.block_n) * triton.cdiv(m, tile.block_m),)
    _fp8_gemm_kernel[grid](
        x, x_scale if x_scale is not None else weight_scale, weight, weight_scale,
        bias if bias is not None else weight_scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        X_FP8=x_scale is not None, HAS_BIAS=bias is not None, EVEN_K=k % tile.block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out


def fp8_w8a16(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None, tile: W8A16Tile | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) times the fp8 weight [N, K], weight streamed (one launch)."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    tile = tile or choose_w8a16_tile(x.shape[0], weight.shape[0], _num_sms(x.device))
    return _launch(x, None, weight, weight_scale, bias, out, tile)


def fp8_w8a8_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, tile: W8A16Tile = W8A8_TILE) -> torch.Tensor:
    """x quantized per token, then this module's fp8 x fp8 kernel (both scales in its epilogue);
    timed against cuBLASLt's by `bench kernels --fp8`."""
    x_q, x_scale = quantize_per_token(x)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x_q, x_scale, weight, weight_scale, bias, out, tile)


class QuantizedRows(NamedTuple):
    """Activations already quantized per token (fp8_quant's format) by the op before the layer, e.g.
    `fused_norm.rmsnorm_fp8`: the W8A8 path then starts at its GEMM."""

    q: torch.Tensor  # [M, K] e4m3
    scale: torch.Tensor  # [M, 1] fp32
    dtype: torch.dtype  # of the activations they stand for (the layer's output dtype)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def takes_quantized_rows(num_rows: int, dtype: torch.dtype, weight_shape: tuple[int, int]) -> bool:
    """The W8A8 path (per-token quantization, cuBLASLt): bf16 steps past W8A16_MAX_ROWS, for
    weights whose sizes cuBLASLt's fp8 GEMM takes."""
    n, k = weight_shape
    return num_rows > W8A16_MAX_ROWS and dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def fp8_scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLASLt's fp8 GEMM with row-wise scales: x's per token [M, 1], the weight's as [1, N]."""
    out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale_row, out_dtype=out_dtype,
                           use_fast_accum=FAST_ACCUM)
    return out if bias is None else out.add_(bias)


def fp8_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale_row: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized per token, then cuBLASLt's fp8 GEMM with row-wise scales (bf16 out).
    weight_scale_row is the weight scale as [1, N]."""
    x_q, x_scale = quantize_per_token(x)
    return fp8_scaled_mm(x_q, x_scale, weight, weight_scale_row, bias, x.dtype)


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] on the path for its row count (module docstring); QuantizedRows
    (only where takes_quantized_rows) go straight to the GEMM."""
    n, k = weight.shape
    if isinstance(x, QuantizedRows):
        return fp8_scaled_mm(x.q, x.scale, weight, weight_scale.view(1, n), bias, x.dtype)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if takes_quantized_rows(rows.shape[0], x.dtype, (n, k)):
        out = fp8_w8a8(rows, weight, weight_scale.view(1, n), bias)
    else:
        out = fp8_w8a16(rows, weight, weight_scale, bias)
    return out.view(*x.shape[:-1], n)


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
