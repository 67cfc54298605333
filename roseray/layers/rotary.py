"""Rotary position embedding (RoPE), neox style as in Hugging Face Llama.

The cos/sin table is computed once for every position up to max_position_embeddings and
indexed by each token's position, so a flattened batch of any sequences rotates in one go.
Supported `rope_scaling` types: default, linear, llama3, yarn, longrope (the attention factor
of yarn and longrope scales the cos/sin table itself, so every path that reads the table
applies it).

`RotaryEmbedding.rotate_qk` rotates a layer's q and k (after Qwen3's per-head q/k norm when
given): on CUDA one in-place Triton launch that reads the fp32 table by position
(roseray_kernels.rotary), elsewhere the torch code below.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from roseray.layers import fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    the band between interpolated smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, smoothed)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def _yarn_factor(scaling: dict, max_position: int | None) -> tuple[float, int]:
    """(factor, original context length); a missing factor is the ratio of the two lengths."""
    original = scaling.get("original_max_position_embeddings") or max_position
    if original is None:
        raise ValueError("yarn rope_scaling needs original_max_position_embeddings")
    factor = scaling.get("factor") or (max_position / original if max_position else None)
    if factor is None:
        raise ValueError("yarn rope_scaling needs factor")
    return float(factor), int(original)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict, max_position: int | None) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than `beta_slow` times over the original context are
    interpolated (frequency / factor), those turning more than `beta_fast` times are kept, and
    the band between blends the two linearly by dimension index. `truncate` (default true)
    rounds the band's ends outwards to whole dimensions."""
    factor, original = _yarn_factor(scaling, max_position)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32.0, scaling.get("beta_slow") or 1.0

    def dimension_of(rotations: float) -> float:  # the dimension index turning `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: a fast dimension, kept (extrapolated); 0: a slow one, interpolated
    wavelength_base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return 1.0 / (factor * wavelength_base) * (1 - kept) + 1.0 / wavelength_base * kept


def _longrope_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_position: int) -> torch.Tensor:
    """LongRoPE (Phi-3): each frequency divided by its own factor, `long_factor` when the model's
    context reaches past `original_max_position_embeddings`, else `short_factor`.

    Transformers picks the factors per forward by the longest sequence in it, so a sequence that
    grows past the original length changes the rotation of the keys already cached. A batched
    engine with a paged cache needs one rotation per position for every request: like vLLM
    (which chooses by max_model_len), the choice is made once, for the whole model, by the
    context it serves (`max_position`, the table's length)."""
    long = max_position > scaling.get("original_max_position_embeddings", max_position)
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"longrope factors have {factors.numel()} entries; head_dim {2 * inv_freq.numel()} "
                         f"needs {inv_freq.numel()}")
    return inv_freq / factors


def rope_attention_factor(rope_scaling: dict | None, max_position: int | None = None) -> float:
    """The factor RoPE's cos and sin are multiplied by; 1 except for
    - yarn: `attention_factor` when given, else 0.1 * ln(factor) + 1 (DeepSeek's mscale /
      mscale_all_dim ratio when both are given);
    - longrope: `attention_factor` when given, else sqrt(1 + ln(factor) / ln(original length))
      with factor = max_position / original length unless given (the original length
      defaults to max_position)."""
    kind = rope_type(rope_scaling)
    if kind == "yarn":
        if rope_scaling.get("attention_factor") is not None:
            return float(rope_scaling["attention_factor"])
        factor, _ = _yarn_factor(rope_scaling, max_position)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    if kind == "longrope":
        if rope_scaling.get("attention_factor") is not None:
            return float(rope_scaling["attention_factor"])
        original = rope_scaling.get("original_max_position_embeddings", max_position)
        factor = rope_scaling.get("factor") or max_position / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def compute_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None,
                     max_position: int | None = None) -> torch.Tensor:
    """The [head_dim // 2] inverse frequencies; `max_position` (the table's length) is needed by
    longrope, and by yarn when its scaling omits the original length or the factor."""
    kind = rope_type(rope_scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    if kind == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(head_dim, theta, rope_scaling, max_position)
    elif kind == "longrope":
        inv_freq = _longrope_inv_freq(inv_freq, rope_scaling, max_position)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, rope_scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, theta, rope_scaling, max_position)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(positions.device))  # [max_position, head_dim // 2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, head_dim], fp32
        cos_sin *= rope_attention_factor(rope_scaling, max_position)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [num_tokens] -> their cos|sin rows [num_tokens, head_dim], gathered once per step."""
        return self.cos_sin_cache[positions]

    def rotate_qk(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]; a view of the qkv projection is fine
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        q_norm: nn.Module | None = None,  # RMSNorm(head_dim) of each head before the rotation (Qwen3)
        k_norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) normalised (when norms are given) and rotated. The Triton path works in
        place and returns q and k themselves; the torch path returns new tensors."""
        if fused.use_triton(q):
            weights = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else (None, None, 1e-6)
            fused.rotary_qk_(q, k, positions, self.cos_sin_cache, *weights)
            return q, k
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos_sin = self(positions).to(q.dtype)  # [num_tokens, head_dim]
        return apply_rotary(q, cos_sin), apply_rotary(k, cos_sin)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cos_sin: torch.Tensor,  # [num_tokens, head_dim], from RotaryEmbedding
) -> torch.Tensor:
    """Neox-style rotation of the two halves of the head dimension, in x's dtype."""
    cos, sin = cos_sin.to(x.dtype).unsqueeze(1).chunk(2, dim=-1)  # each [num_tokens, 1, head_dim // 2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
