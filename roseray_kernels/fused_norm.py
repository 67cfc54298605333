"""RMSNorm and LayerNorm with an optional fused residual add: one launch per norm instead of
the ~8 elementwise and reduce kernels of the torch RMSNorm expression, or LayerNorm's and the
add's two.

    out = rmsnorm(x, weight, eps)                         # out = norm(x) * weight
    out, residual = rmsnorm(x, weight, eps, residual)     # residual = x + residual; out = norm(residual) * weight
    out = layernorm(x, weight, bias, eps)                 # F.layer_norm(x, ..., weight, bias, eps)
    out, residual = layernorm(x, weight, bias, eps, residual)

Rounding follows Hugging Face's `LlamaRMSNorm` (and `residual + hidden` before it) step by
step, so the kernel and the torch reference agree to the last bit but for the order of the
sum of squares: the residual sum is rounded to the activation dtype, the statistics are fp32,
`x * rstd` is rounded to the activation dtype before the weight multiplies it, and the output
has the input's dtype.

LayerNorm follows torch's CUDA F.layer_norm (GPT-2): fp32 mean and variance (biased), then
`weight * ((x - mean) * rstd) + bias` in fp32, rounded once to the input dtype; the residual
sum is rounded like torch's add. The kernel takes the variance in two passes over the row in
registers where torch runs Welford: the statistics agree to fp32 rounding, not to the bit.

Rows are the leading dims flattened (`[num_tokens, hidden]`, or `[num_tokens * num_heads,
head_dim]` for Qwen3's per-head q/k norm); x may have a row stride (a view), the outputs are
new contiguous tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE


@triton.jit
def _load_rows(x_ptr, residual_ptr, residual_out_ptr, num_rows, stride_x, stride_res,
               HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """This program's rows of x ([ROWS, BLOCK_H], padding 0), with the residual added and the
    sum stored when HAS_RESIDUAL; also the row indexes, columns and masks for the stores."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    col_ok = cols < HIDDEN
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # rounded like torch's `x + residual`
        tl.store(residual_out_ptr + rows[:, None] * HIDDEN + cols[None, :], x, mask=mask)
    return x, rows, cols, col_ok, mask


@triton.jit(do_not_specialize=["num_rows"])
def _rmsnorm_kernel(
    x_ptr,  # [num_rows, HIDDEN], row stride stride_x
    residual_ptr,  # [num_rows, HIDDEN], row stride stride_res (unused without HAS_RESIDUAL)
    weight_ptr,  # [HIDDEN]
    out_ptr,  # [num_rows, HIDDEN] contiguous
    residual_out_ptr,  # [num_rows, HIDDEN] contiguous: x + residual
    num_rows,
    stride_x,
    stride_res,
    eps,
    scale_ptr,  # [num_rows] fp32 with QUANT: each row's e4m3 scale (else unused)
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two of HIDDEN
    ROWS: tl.constexpr,  # rows per program
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,  # out is e4m3: the normed row (in x's dtype) quantized per row, as fp8_quant does
    FP8_MAX_VALUE: tl.constexpr,
    MIN_SCALE_VALUE: tl.constexpr,
):
    x, rows, cols, col_ok, mask = _load_rows(x_ptr, residual_ptr, residual_out_ptr, num_rows, stride_x, stride_res,
                                             HIDDEN, BLOCK_H, ROWS, HAS_RESIDUAL)
    dtype = x.dtype
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / HIDDEN + eps)  # [ROWS]
    normed = (xf * rstd[:, None]).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = (normed * weight[None, :]).to(dtype)
    if QUANT:
        outf = tl.where(mask, out.to(tl.float32), 0.0)
        scale = tl.maximum(tl.max(tl.abs(outf), axis=1) / FP8_MAX_VALUE, MIN_SCALE_VALUE)  # [ROWS]
        q = tl.minimum(tl.maximum(outf / scale[:, None], -FP8_MAX_VALUE), FP8_MAX_VALUE)
        tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + rows, scale, mask=rows < num_rows)
    else:
        tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _layernorm_kernel(
    x_ptr,  # [num_rows, HIDDEN], row stride stride_x
    residual_ptr,  # [num_rows, HIDDEN], row stride stride_res (unused without HAS_RESIDUAL)
    weight_ptr,  # [HIDDEN]
    bias_ptr,  # [HIDDEN]
    out_ptr,  # [num_rows, HIDDEN] contiguous
    residual_out_ptr,  # [num_rows, HIDDEN] contiguous: x + residual
    num_rows,
    stride_x,
    stride_res,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two of HIDDEN
    ROWS: tl.constexpr,  # rows per program
    HAS_RESIDUAL: tl.constexpr,
):
    x, rows, cols, col_ok, mask = _load_rows(x_ptr, residual_ptr, residual_out_ptr, num_rows, stride_x, stride_res,
                                             HIDDEN, BLOCK_H, ROWS, HAS_RESIDUAL)
    dtype = x.dtype
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / HIDDEN  # [ROWS]
    centered = tl.where(mask, xf - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / HIDDEN + eps)  # [ROWS], biased variance
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = weight[None, :] * (centered * rstd[:, None]) + bias[None, :]
    tl.store(out_ptr + rows[:, None] * HIDDEN + cols[None, :], out.to(dtype), mask=mask)


def _launch_shape(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_H, rows per program, num_warps): about 1-2k elements per program, 16 bytes per thread."""
    block_h = triton.next_power_of_2(hidden)
    rows = max(1, min(16, 1024 // block_h))
    elements = block_h * rows
    num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16
    return block_h, rows, num_warps


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """t as [num_rows, hidden] with unit column stride, a view when the layout allows."""
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _launch_norm(kernel, x: torch.Tensor, params: tuple[torch.Tensor, ...], eps: float,
                 residual: torch.Tensor | None, out: torch.Tensor | None = None,
                 **kernel_args) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run `kernel` (x, residual, *params, out, residual_out, ..., **kernel_args) over the rows of x;
    `out` (shaped like x) defaults to a new tensor in x's dtype."""
    hidden = x.shape[-1]
    assert all(p.shape == (hidden,) for p in params), ([p.shape for p in params], x.shape)
    x2 = _rows(x, hidden)
    num_rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if residual is None:
        res2, residual_out = x2, out  # unused by the kernel
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype, x.dtype)
        res2 = _rows(residual, hidden)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows:
        block_h, rows, num_warps = _launch_shape(hidden)
        kernel[(triton.cdiv(num_rows, rows),)](
            x2, res2, *params, out, residual_out, num_rows, x2.stride(0), res2.stride(0), eps,
            HIDDEN=hidden, BLOCK_H=block_h, ROWS=rows, HAS_RESIDUAL=residual is not None, num_warps=num_warps,
            **kernel_args,
        )
    return out if residual is None else (out, residual_out)


def rmsnorm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with `residual`, (norm(x + residual) * weight, x + residual). One launch."""
    return _launch_norm(_rmsnorm_kernel, x, (weight,), eps, residual, scale_ptr=x, QUANT=False,
                        FP8_MAX_VALUE=FP8_MAX, MIN_SCALE_VALUE=MIN_SCALE)


def rmsnorm_fp8(
    x: torch.Tensor,  # [num_rows, hidden], bf16/fp16
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x
) -> tuple[torch.Tensor, torch.Tensor] | tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`quantize_per_token(rmsnorm(x, weight, eps))` in one launch: (e4m3 [num_rows, hidden], fp32
    scale [num_rows, 1]), the very values of the two steps (the norm rounds to x's dtype before it is
    quantized); with `residual`, ((q, scale), x + residual)."""
    assert x.dim() == 2, x.shape
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    result = _launch_norm(_rmsnorm_kernel, x, (weight,), eps, residual, out=q, scale_ptr=scale, QUANT=True,
                          FP8_MAX_VALUE=FP8_MAX, MIN_SCALE_VALUE=MIN_SCALE)
    return (q, scale) if residual is None else ((q, scale), result[1])


def layernorm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    bias: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm(x) (affine); with `residual`, (LayerNorm(x + residual), x + residual). One launch."""
    return _launch_norm(_layernorm_kernel, x, (weight, bias), eps, residual)


def layernorm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: F.layer_norm after `x + residual` (Hugging Face's GPT-2 block order)."""
    if residual is not None:
        x = x + residual
    out = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return out if residual is None else (out, x)


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference, Hugging Face's LlamaRMSNorm after `x + residual` (the CPU path and the oracle)."""
    if residual is not None:
        x = x + residual
    input_dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = weight * normed.to(input_dtype)
    return out if residual is None else (out, x)
