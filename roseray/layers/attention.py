"""Paged attention layer and its backends.

Every model calls `Attention(q, k, v)`; the layer writes this step's K/V into the paged
cache at `slot_mapping` and attends through the block tables. The per-step metadata is
set once per step by the model runner (`attention_metadata(...)`) and read by every
layer, so no layer builds index tensors of its own.

Cache layout, per layer: `k_cache`, `v_cache` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`; one block id spans all layers. The cache
is in the model's dtype, or fp8 e4m3 (roseray.layers.kv_fp8) with the layer's `k_scale` and
`v_scale`: backends quantize on store and dequantize on read; other caches ignore the scales.

Backends:
- `TorchAttentionBackend`: the reference, used on CPU and as the GPU fallback.
- `TritonAttentionBackend` (roseray_kernels): the default on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from roseray.layers.kv_fp8 import dequantize_fp8, is_fp8, quantize_fp8


@dataclass
class AttentionMetadata:
    """What every layer needs to know about the step's flattened batch.

    Tokens are flattened sequence after sequence; sequence i owns query rows
    `query_start_loc[i] : query_start_loc[i + 1]`, which are the last `query_len` of its
    `seq_len` tokens (the tokens before them are already in the cache).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, not written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, tokens in the cache once this step is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    num_seqs: int
    block_size: int


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
        k_scale: float = 1.0,  # fp8 cache: stored = key / k_scale
        v_scale: float = 1.0,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # written in place when given
        *,
        sliding_window: int | None = None,  # keys within the last `sliding_window` positions only
        softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
        sinks: torch.Tensor | None = None,  # [num_heads] logits of a per-head sink in every softmax
        k_scale: float = 1.0,  # fp8 cache: key = stored * k_scale
        v_scale: float = 1.0,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


class TorchAttentionBackend:
    """Reference paged attention in plain torch (vectorised over sequences)."""

    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        slot_mapping = slot_mapping[: key.shape[0]].long()
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        if is_fp8(k_cache):  # index_copy_ has no fp8 kernel on every device: copy the bytes
            key, value = quantize_fp8(key, k_scale).view(torch.uint8), quantize_fp8(value, v_scale).view(torch.uint8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None, *, sliding_window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        result = paged_attention_reference(query, k_cache, v_cache, meta, scale, sliding_window=sliding_window,
                                           softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        return result if out is None else out.copy_(result)


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached tokens, in fp32.

    sliding_window: a query at position p sees keys at positions > p - sliding_window.
    softcap: scores (after `scale`) become softcap * tanh(scores / softcap).
    sinks: one extra logit per head in every softmax's denominator, attending to nothing.
    k_scale, v_scale: an fp8 cache's gathered keys and values are dequantized with them.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs, block_size = meta.num_seqs, meta.block_size
    device = query.device

    qsl = meta.query_start_loc[: num_seqs + 1].long()
    seq_lens = meta.seq_lens[:num_seqs].long()
    query_lens = qsl[1:] - qsl[:-1]  # [num_seqs]
    max_q, max_kv = meta.max_query_len, meta.max_seq_len
    num_ctx_blocks = (max_kv + block_size - 1) // block_size

    # Gather each sequence's K/V through its block table.
    tables = meta.block_tables[:num_seqs, :num_ctx_blocks].long().clamp_min(0)
    keys = k_cache[tables].reshape(num_seqs, num_ctx_blocks * block_size, num_kv_heads, head_dim)[:, :max_kv]
    values = v_cache[tables].reshape(num_seqs, num_ctx_blocks * block_size, num_kv_heads, head_dim)[:, :max_kv]
    if is_fp8(k_cache):
        keys, values = dequantize_fp8(keys, k_scale), dequantize_fp8(values, v_scale)
    keys = keys.float().repeat_interleave(group, dim=2)  # [num_seqs, max_kv, num_heads, head_dim]
    values = values.float().repeat_interleave(group, dim=2)

    # Scatter the flattened queries into a padded [num_seqs, max_q] grid.
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)
    row_in_seq = torch.arange(num_tokens, device=device)[: int(qsl[-1])] - qsl[seq_idx]
    padded_q = query.new_zeros((num_seqs, max_q, num_heads, head_dim), dtype=torch.float32)
    padded_q[seq_idx, row_in_seq] = query[: int(qsl[-1])].float()

    scores = torch.einsum("bqhd,bkhd->bhqk", padded_q, keys) * scale  # [num_seqs, num_heads, max_q, max_kv]
    q_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=device)[None, :]  # [num_seqs, max_q]
    k_pos = torch.arange(max_kv, device=device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
    if sliding_window is not None:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    else:  # the sink's column joins the softmax and is dropped after it
        sink_column = sinks.float().view(1, num_heads, 1, 1).expand(num_seqs, num_heads, max_q, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values)  # [num_seqs, max_q, num_heads, head_dim]

    result = query.new_zeros(query.shape)
    result[: int(qsl[-1])] = out[seq_idx, row_in_seq].to(query.dtype)
    return result


def causal_attention_no_cache(query, key, value, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for a forward without a KV cache (the memory-profiling run, whose outputs
    are discarded): each sequence attends causally to its own new tokens only, without a
    layer's window, softcap or sinks."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    out = torch.empty_like(query)
    starts = meta.query_start_loc[: meta.num_seqs + 1].tolist()
    for start, end in zip(starts[:-1], starts[1:]):
        # [1, heads, tokens, head_dim]: SDPA's fused (flash / memory-efficient) kernels take 4-D
        # inputs only; a 3-D call runs the math path, whose [heads, tokens, tokens] fp32 scores
        # would inflate the profiled peak by gigabytes at long prompts.
        q = query[start:end].transpose(0, 1)[None]
        k = key[start:end].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)[None]
        v = value[start:end].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)[None]
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        out[start:end] = o[0].transpose(0, 1)
    return out


# The step's metadata and backend, set by the model runner before each forward.
_METADATA: AttentionMetadata | None = None
_BACKEND: AttentionBackend = TorchAttentionBackend()
# Set while the model runner captures piecewise CUDA graphs: called instead of the attention
# itself (after the KV append), it ends the graph being captured and returns the buffer the
# attention will write at replay (roseray.engine.piecewise_graphs).
_SPLIT: Callable[[Attention, torch.Tensor], torch.Tensor] | None = None


def set_attention_backend(backend: AttentionBackend) -> None:
    global _BACKEND
    _BACKEND = backend


@contextlib.contextmanager
def attention_metadata(meta: AttentionMetadata) -> Iterator[None]:
    global _METADATA
    previous, _METADATA = _METADATA, meta
    try:
        yield
    finally:
        _METADATA = previous


@contextlib.contextmanager
def attention_split(split: Callable[[Attention, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    global _SPLIT
    previous, _SPLIT = _SPLIT, split
    try:
        yield
    finally:
        _SPLIT = previous


def get_attention_metadata() -> AttentionMetadata:
    if _METADATA is None:
        raise RuntimeError("attention called outside a model-runner step (no AttentionMetadata set)")
    return _METADATA


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    Takes q [num_tokens, num_heads * head_dim], k and v [num_tokens, num_kv_heads * head_dim]
    (already rotated), returns [num_tokens, num_heads * head_dim].

    Options of a layer: `sliding_window` (a query sees only the keys of its last
    `sliding_window` positions, itself included), `softcap` (scores -> softcap *
    tanh(scores / softcap)), `has_sinks` (a learned per-head logit `sinks` joins every
    softmax's denominator: gpt-oss).

    `k_scale`, `v_scale` (python floats, 1.0 by default): an fp8 cache stores K / k_scale and
    V / v_scale; set them with `set_kv_scales` before the first step (CUDA graphs keep them).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, softcap: float | None = None, has_sinks: bool = False) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if has_sinks else None
        self.k_scale, self.v_scale = 1.0, 1.0
        # Bound by the model runner once the cache is allocated.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def options(self) -> dict:
        """The layer's keyword options for AttentionBackend.forward."""
        return {"sliding_window": self.sliding_window, "softcap": self.softcap, "sinks": self.sinks,
                "k_scale": self.k_scale, "v_scale": self.v_scale}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        meta = get_attention_metadata()
        if self.k_cache is None:
            out = causal_attention_no_cache(q, k, v, meta, self.scale)
        else:
            _BACKEND.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            if _SPLIT is not None:
                out = _SPLIT(self, q)
            else:
                out = _BACKEND.forward(q, self.k_cache, self.v_cache, meta, self.scale, **self.options())
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


def set_kv_scales(layer: Attention, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor) -> None:
    """Set an attention layer's fp8 KV-cache scales (python floats or one-element tensors, e.g. a
    checkpoint's `...self_attn.k_scale` / `v_scale`): the cache stores K / k_scale and V / v_scale.
    Call at load time, before CUDA graphs are captured (they keep the scales as constants)."""
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise ValueError(f"{name} must be one value per layer; got shape {tuple(scale.shape)}")
            scale = scale.item()  # load time, not a forward
        scale = float(scale)
        if not 0.0 < scale < float("inf"):
            raise ValueError(f"{name} must be a positive finite number; got {scale}")
        scales.append(scale)
    layer.k_scale, layer.v_scale = scales
