"""The paged KV cache's size and memory: bytes per block, how many blocks fit on a GPU after
the activation peak of the largest step, and the one tensor every attention layer's cache is
a view of ([2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]). Its dtype is the
cache's (the model's, or fp8 e4m3 at one byte an element), so an fp8 cache holds twice the
blocks of a bf16 one in the same memory."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from roseray.layers.attention import set_kv_scales
from roseray.layers.kv_fp8 import FP8_KV_DTYPE, kv_cache_dtype_name, kv_cache_torch_dtype

logger = logging.getLogger(__name__)


def choose_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device,
                          backend_name: str) -> torch.dtype:
    """The cache dtype for EngineConfig.kv_cache_dtype. The Triton kernels convert e4m3 in
    hardware: an fp8 cache on them needs compute capability 8.9 (Ada) or newer."""
    dtype = kv_cache_torch_dtype(kv_cache_dtype, model_dtype)
    if dtype == FP8_KV_DTYPE and device.type == "cuda" and backend_name == "triton":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                             f"this one is {capability[0]}.{capability[1]}: use kv_cache_dtype auto")
    return dtype


def set_kv_cache_scales(attention_layers: list, checkpoint_scales: dict[int, dict[str, float]],
                        override: float | None, cache_dtype: torch.dtype) -> None:
    """Each layer's K and V scales: the checkpoint's ({layer: {"k": s, "v": s}}, the loader's
    `model.kv_cache_scales`), then EngineConfig.kv_cache_scale over all of them when set."""
    fp8 = cache_dtype == FP8_KV_DTYPE
    for index, scales in checkpoint_scales.items():
        if fp8:
            layer = attention_layers[index]
            set_kv_scales(layer, scales.get("k", layer.k_scale), scales.get("v", layer.v_scale))
    if checkpoint_scales:
        logger.info("KV cache scales of %d layers in the checkpoint: %s", len(checkpoint_scales),
                    "used" if fp8 and override is None else "not used (" + (
                        "kv_cache_scale overrides them)" if fp8 else "the KV cache is not fp8)"))
    if override is None:
        return
    for layer in attention_layers:
        set_kv_scales(layer, override, override)
    if not fp8:
        logger.warning("kv_cache_scale=%s has no effect on a %s KV cache (kv_cache_dtype fp8 uses it)", override,
                       kv_cache_dtype_name(cache_dtype))


def kv_bytes_per_block(attention_layers: list, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one block across all layers, K and V, in the cache dtype `dtype` (the layers'
    own KV heads: under tensor parallelism, this rank's share)."""
    layer = attention_layers[0]
    return 2 * len(attention_layers) * layer.num_kv_heads * layer.head_dim * dtype.itemsize * block_size


def profile_gpu_blocks(device: torch.device, gpu_memory_utilization: float, bytes_per_block: int,
                       profile_forward: Callable[[], None]) -> int:
    """The blocks that fit in `gpu_memory_utilization` of the GPU after `profile_forward`'s peak
    (the largest step's activations) and the memory outside torch."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)  # the weights (and buffers)
    profile_forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = total * gpu_memory_utilization - peak - outside_torch
    num_blocks = int(budget // bytes_per_block)
    logger.info("GPU memory: %.2f GiB x %.2f = %.2f GiB for weights %.2f GiB, activation peak %.2f GiB, outside "
                "torch %.2f GiB (CUDA context, libraries) and the KV cache %.2f GiB",
                total / 2**30, gpu_memory_utilization, total * gpu_memory_utilization / 2**30, resident / 2**30,
                (peak - resident) / 2**30, outside_torch / 2**30, max(budget, 0) / 2**30)  # fmt: skip
    if num_blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache: peak {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB "
            f"at gpu_memory_utilization={gpu_memory_utilization}; raise it or lower max_num_batched_tokens")
    torch.cuda.empty_cache()
    return num_blocks


def allocate_kv_cache(attention_layers: list, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The cache tensor; each attention layer gets its k_cache and v_cache views."""
    layer = attention_layers[0]
    shape = (2, len(attention_layers), num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
    kv_cache = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(attention_layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
    return kv_cache
