"""Triton attention backend: KV append + paged attention kernels from roseray_kernels.

Implements the AttentionBackend protocol of roseray.layers.attention. Both calls are
CUDA-graph capturable for decode steps: they read lengths and tables from device memory
and size their grids from shapes and the metadata's python ints only. A layer's options
are constants of the layer (the window, softcap and fp8 KV scales python numbers, the sinks a
parameter whose address does not change), so a captured step replays them as they were.
"""

from __future__ import annotations

import torch

from roseray.layers.attention import AttentionMetadata
from roseray_kernels import kv_append, paged_attention


class TritonAttentionBackend:
    name = "triton"

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [>= num_tokens]; -1 = padding
        k_scale: float = 1.0,  # fp8 cache: stored = key / k_scale
        v_scale: float = 1.0,
    ) -> None:
        kv_append(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        *,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,  # fp8 cache: key = stored * k_scale
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        num_seqs = meta.num_seqs
        return paged_attention(
            query, k_cache, v_cache,
            meta.query_start_loc[: num_seqs + 1], meta.seq_lens[:num_seqs], meta.block_tables[:num_seqs],
            scale, meta.max_query_len, meta.max_seq_len, out=out,
            sliding_window=sliding_window, softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        )
