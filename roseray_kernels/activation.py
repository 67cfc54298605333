"""Activation-and-mul of a gated MLP: [num_tokens, 2 * inter] (gate | up) -> act(gate) * up, one
launch instead of the activation, the product and the copies of the two halves. act: SiLU
(Llama family) or GELU's tanh approximation (Gemma).

Rounding follows torch on the activation dtype: act(gate) is rounded to the dtype before
the product (as `F.silu(gate) * up` does), the product once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program
NUM_WARPS = 4


@triton.jit
def _act_and_mul_kernel(
    gate_up_ptr,  # [num_tokens, 2 * inter], row stride stride_in
    out_ptr,  # [num_tokens, inter] contiguous
    inter,
    stride_in,
    GELU_TANH: tl.constexpr,  # gelu's tanh approximation (Gemma) instead of silu
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(y)); tanh(|y|) = (1 - e) / (1 + e) with e = exp(-2|y|), which cannot overflow
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
        e = tl.exp(-2.0 * tl.abs(y))
        tanh_abs = (1.0 - e) / (1.0 + e)
        act = (0.5 * g * (1.0 + tl.where(y >= 0, tanh_abs, -tanh_abs))).to(gate.dtype)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * inter + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _act_and_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1, \
        (gate_up.shape, gate_up.stride())
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        _act_and_mul_kernel[(num_tokens, triton.cdiv(inter, BLOCK))](
            gate_up, out, inter, gate_up.stride(0), GELU_TANH=gelu_tanh, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * inter] -> silu(gate) * up [num_tokens, inter]."""
    return _act_and_mul(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [num_tokens, 2 * inter] -> gelu_tanh(gate) * up [num_tokens, inter]."""
    return _act_and_mul(gate_up, gelu_tanh=True)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
