"""The fp8 KV cache's number format in torch: e4m3 (torch.float8_e4m3fn) with one scale per
layer for K and one for V. Stored value = clamp(value * (1 / scale), -448, 448) cast to e4m3
(saturating: out-of-range values become +-448, never NaN); read value = stored * scale.

The torch attention backend quantizes and dequantizes with these; the Triton kernels
(roseray_kernels.kv_append / paged_attention) do the same arithmetic on the GPU.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 (fn) value


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for EngineConfig.kv_cache_dtype ("auto": the model's)."""
    return FP8_KV_DTYPE if kv_cache_dtype == "fp8" else model_dtype


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """How logs name a cache dtype: "fp8 e4m3", "bfloat16", ..."""
    return "fp8 e4m3" if dtype == FP8_KV_DTYPE else str(dtype).removeprefix("torch.")


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) as e4m3 cache values: clamp(x * (1 / scale) in fp32, +-448), cast."""
    inv = torch.tensor(1.0 / scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 cache values as fp32 values: stored * scale."""
    return stored.float() * scale
