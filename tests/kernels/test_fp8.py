"""FP8 kernels against torch references: per-channel weight and per-token activation quantization,
the weight-streaming W8A16 GEMM (decode rows) and the quantized-activation W8A8 path (prefill rows).

On CPU the Triton kernels run under the interpreter on small shapes (torch._scaled_mm has a CPU
implementation for the W8A8 path); on CUDA the Llama-8B projection shapes run in bf16.
"""

from __future__ import annotations

import pytest
import torch

from roseray_kernels.fp8_gemm import (
    W8A16_MAX_ROWS,
    QuantizedRows,
    W8A16Tile,
    fp8_linear,
    fp8_linear_reference,
    fp8_scaled_mm,
    fp8_w8a8,
    fp8_w8a8_triton,
    fp8_w8a16,
)
from roseray_kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    quantize_per_channel,
    quantize_per_token,
    quantize_per_token_reference,
)
from roseray_kernels.fused_norm import rmsnorm, rmsnorm_fp8
from tests.kernels.helpers import rel_err

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


def test_per_channel_weight_quantization_bounds_and_error():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=gen)
    w[3] *= 100.0  # one loud channel does not coarsen the others (scales are per row)
    w[7] = 0.0  # an all-zero row dequantizes to zeros, not NaN
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (48,) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 3]], torch.full((2,), FP8_MAX))
    back = q.float() * scale[:, None]
    assert torch.equal(back[7], torch.zeros(96)) and torch.isfinite(back).all()
    for row in (0, 3, 10):  # e4m3 keeps 3 mantissa bits: relative error per row well under 4%
        assert rel_err(back[row], w[row]) < 0.04


@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 1000), (3, 2500)])
def test_per_token_quantization_matches_reference(rows, cols):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 2, rows)[:, None]).to(DEVICE)
    x[0, :7] = 0.0
    q, scale = quantize_per_token(x)
    want_q, want_scale = quantize_per_token_reference(x)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    assert q.dtype == FP8_DTYPE
    differ = q.float() != want_q.float()
    if not ON_CUDA:  # Triton 3.9's interpreter loses the carry of a value rounding up to a power of two
        differ &= 2 * q.float() != want_q.float()  # (124.3 -> 64 instead of 128); GPUs cast right
    assert not differ.any()


def test_per_token_quantization_of_zero_and_huge_rows_is_finite():
    x = torch.zeros(2, 32, device=DEVICE)
    x[1] = 1e30
    q, scale = quantize_per_token(x)
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all()
    assert torch.equal(q[0].float(), torch.zeros(32, device=DEVICE))


def _linear_case(rows, n, k, bias, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, scale = quantize_per_channel(w)
    x = torch.randn(rows, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(x).to(dtype), to(q), to(scale), None if b is None else to(b).to(dtype)


@pytest.mark.parametrize("rows,n,k,bias", [(1, 64, 128, False), (7, 96, 256, True), (33, 40, 200, False)])
def test_w8a16_kernel_matches_dequantized_reference(rows, n, k, bias):
    x, q, scale, b = _linear_case(rows, n, k, bias, torch.float32)
    want = fp8_linear_reference(x, q, scale, b)
    got = fp8_w8a16(x, q, scale, b, tile=W8A16Tile(16, 32, 64, 4, 2))
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_path_multiplies_the_quantized_activations_and_weights(bias):
    x, q, scale, b = _linear_case(W8A16_MAX_ROWS + 3, 64, 128, bias, torch.bfloat16)
    x_q, x_scale = quantize_per_token(x)
    exact = fp8_linear_reference(x_q.float() * x_scale, q, scale, None if b is None else b.float())
    got = fp8_w8a8(x, q, scale.view(1, -1), b)
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert rel_err(got, exact) < 0.01  # the scales applied per row and per column; bf16 output
    unquantized = fp8_linear_reference(x.float(), q, scale, None if b is None else b.float())
    assert rel_err(got, unquantized) < 0.08  # activations rounded to e4m3's 3 mantissa bits
    triton_kernel = fp8_w8a8_triton(x, q, scale, b, tile=W8A16Tile(16, 32, 64, 4, 2))
    assert rel_err(triton_kernel, exact) < 0.01


def test_fp8_linear_picks_the_path_by_rows_and_keeps_leading_dims():
    x, q, scale, _ = _linear_case(2 * 3, 48, 64, False, torch.float32)
    got = fp8_linear(x.view(2, 3, 64), q, scale)
    assert got.shape == (2, 3, 48)
    assert rel_err(got.view(6, 48), fp8_linear_reference(x, q, scale)) < 1e-5


@pytest.mark.skipif(not ON_CUDA, reason="bf16 fp8 GEMMs at Llama-8B shapes need CUDA")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("rows", [1, 16, 17, 64, 512])
def test_fp8_linear_llama8b_shapes_on_gpu(n, k, rows):
    x, q, scale, _ = _linear_case(rows, n, k, False, torch.bfloat16)
    want = fp8_linear_reference(x.float(), q, scale)
    got = fp8_linear(x, q, scale)
    assert rel_err(got, want) < (0.01 if rows <= W8A16_MAX_ROWS else 0.06)
    if rows > W8A16_MAX_ROWS:
        assert rel_err(fp8_w8a8_triton(x, q, scale), want) < 0.06
    graph = torch.cuda.CUDAGraph()  # capturable: replays on new inputs
    with torch.cuda.graph(graph):
        captured = fp8_linear(x, q, scale)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(captured, fp8_linear_reference(x.float(), q, scale)) < 0.06


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows, hidden", [(1, 48), (19, 64), (40, 96)])
def test_the_norm_that_quantizes_gives_the_two_steps_values(rows, hidden, with_residual):
    """rmsnorm_fp8 = quantize_per_token(rmsnorm(...)), bit for bit (the norm's output is rounded to
    the activations' dtype before either quantizes it), with the residual sum as rmsnorm's."""
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=gen) * torch.logspace(-2, 2, rows)[:, None]).to(DEVICE, dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype) if with_residual else None
    weight = torch.randn(hidden, generator=gen).to(DEVICE, dtype)
    x[0, :5] = 0.0
    fused_result = rmsnorm_fp8(x, weight, 1e-6, residual)
    two_steps = rmsnorm(x, weight, 1e-6, residual)
    (q, scale), normed = (fused_result, two_steps) if residual is None else (fused_result[0], two_steps[0])
    if residual is not None:
        torch.testing.assert_close(fused_result[1], two_steps[1], atol=0, rtol=0)
    want_q, want_scale = quantize_per_token(normed)
    assert q.dtype == FP8_DTYPE and scale.shape == (rows, 1)
    torch.testing.assert_close(scale, want_scale, atol=0, rtol=0)
    assert torch.equal(q.float(), want_q.float())


def test_quantized_rows_go_straight_to_the_gemm():
    """fp8_linear of QuantizedRows = fp8_linear of the rows they quantize (the W8A8 path)."""
    x, weight, weight_scale, bias = _linear_case(24, 32, 64, True, torch.float32)
    rows_q, rows_scale = quantize_per_token(x)
    want = fp8_scaled_mm(rows_q, rows_scale, weight, weight_scale.view(1, -1), bias, torch.float32)
    got = fp8_linear(QuantizedRows(rows_q, rows_scale, torch.float32), weight, weight_scale, bias)
    assert torch.equal(got, want)
    assert rel_err(got, fp8_linear_reference(x, weight, weight_scale, bias)) < 0.1  # e4m3 activations
