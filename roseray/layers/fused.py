"""Where the layers use roseray_kernels' fused Triton kernels: on CUDA tensors (on CPU only
inside `fused_kernels(True)`: tests, under TRITON_INTERPRET=1). Everywhere else the layers
run their torch code, the reference the kernels are tested against.

The choice is made per call from the tensor's device (a Python branch, so a CUDA graph
captures the kernel path); Triton stays optional where there is no GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

try:
    from roseray_kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from roseray_kernels.fp8_gemm import QuantizedRows, fp8_linear, fp8_linear_reference, takes_quantized_rows
    from roseray_kernels.fp8_quant import quantize_per_channel
    from roseray_kernels.fused_moe import fused_moe
    from roseray_kernels.fused_norm import layernorm, rmsnorm, rmsnorm_fp8
    from roseray_kernels.rotary import rotary_qk_
    from roseray_kernels.sampling import gumbel_max_sample, variant_row_counts
    from roseray_kernels.token_bitmask import apply_token_bitmask_

    HAVE_TRITON = True
except ImportError:  # Triton is not installed (not Linux): the torch paths need none
    silu_and_mul = gelu_tanh_and_mul = layernorm = rmsnorm = rotary_qk_ = gumbel_max_sample = None
    variant_row_counts = apply_token_bitmask_ = fused_moe = None
    fp8_linear = fp8_linear_reference = quantize_per_channel = None  # fp8 weights need Triton's package
    QuantizedRows = takes_quantized_rows = rmsnorm_fp8 = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "QuantizedRows", "apply_token_bitmask_", "fp8_linear", "fp8_linear_reference", "fused_moe",
           "gelu_tanh_and_mul", "gumbel_max_sample", "quantize_per_channel", "rmsnorm_fp8", "takes_quantized_rows",
           "variant_row_counts", "layernorm", "rmsnorm", "rotary_qk_", "silu_and_mul", "fused_kernels", "use_triton"]

_OVERRIDE: bool | None = None  # set by fused_kernels(): True/False everywhere, None = CUDA tensors only


def use_triton(x: torch.Tensor) -> bool:
    return HAVE_TRITON and (x.is_cuda if _OVERRIDE is None else _OVERRIDE)


@contextlib.contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """Inside: the layers use the Triton kernels for every tensor (enabled; on CPU that needs
    TRITON_INTERPRET=1 before Triton is imported: tests) or for none (the torch path on CUDA:
    benchmarks' baseline)."""
    global _OVERRIDE
    previous, _OVERRIDE = _OVERRIDE, enabled
    try:
        yield
    finally:
        _OVERRIDE = previous
