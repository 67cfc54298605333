"""KV append: write the K/V rows of one step into the paged cache by slot mapping.

One Triton launch per layer per step moves K and V of every token of the step (decode
tokens, prefill chunks, tokens that open a new block) to `slot_mapping[token]`, a flat
slot index `block_id * block_size + offset`. Slot -1 marks padding (CUDA-graph buckets)
and is skipped. Nothing is built per call on the host: the grid is the token count.

Cache layout, per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous,
so slot `s` starts at element `s * num_kv_heads * head_dim`.

fp8 cache (torch.float8_e4m3fn): the kernel stores clamp(x * (1 / scale), -448, 448) rounded
to the nearest e4m3 value (ties to even), i.e. torch's `.clamp(-448, 448).to(float8_e4m3fn)`
of the scaled fp32 row, bit for bit; out-of-range values saturate instead of becoming NaN.
Any other cache dtype takes the plain copy (a compile-time branch; the scales are unused).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 (fn) value

# Tokens per program; 1 keeps a decode step of a few hundred tokens spread over the SMs.
TOKENS_PER_PROGRAM = 1
NUM_WARPS = 4


@triton.jit
def _round_to_e4m3(x):
    """fp32 x with |x| <= 448 rounded to the nearest e4m3 value (ties to even), still fp32, so
    the cast that follows is exact on every backend (the Triton interpreter's own fp8 downcast
    does not round to nearest). Adding and subtracting 2^(e + 20), e = max(exponent of x, -6),
    leaves x's bits down to e4m3's spacing 2^(e - 3) at x (fp32 addition rounds ties to even);
    the sign bit is put back afterwards, so -0.0 stays -0.0."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    magic = ((exponent + 20 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(x) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_e4m3(x, inv_scale):
    """x * inv_scale, saturated to +-448 and rounded: the e4m3 cache value."""
    y = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0)  # also keeps the multiply out of an FMA
    return _round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit(do_not_specialize=["num_tokens"])
def _kv_append_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], heads contiguous in a row
    value_ptr,
    k_cache_ptr,  # [num_blocks * block_size, num_kv_heads * head_dim] (contiguous)
    v_cache_ptr,
    slot_ptr,  # [>= num_tokens] int32 or int64
    num_tokens,
    stride_key_token,
    stride_value_token,
    k_inv_scale,  # 1 / k_scale (FP8 only)
    v_inv_scale,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,  # next power of two of ROW
    BLOCK_T: tl.constexpr,  # tokens per program
    FP8: tl.constexpr,  # the cache is e4m3: quantize with the scales
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    in_range = tokens < num_tokens
    cols = tl.arange(0, ROW_PAD)  # [ROW_PAD]
    col_ok = (cols < ROW)[None, :]
    # The K/V loads do not wait for the slot load (padding rows are read, never stored):
    # the two memory round trips overlap, which is most of a small step's time.
    slots = tl.load(slot_ptr + tokens, mask=in_range, other=-1).to(tl.int64)
    tokens = tokens.to(tl.int64)
    k = tl.load(key_ptr + tokens[:, None] * stride_key_token + cols[None, :], mask=in_range[:, None] & col_ok)
    v = tl.load(value_ptr + tokens[:, None] * stride_value_token + cols[None, :], mask=in_range[:, None] & col_ok)
    store = (slots >= 0)[:, None] & col_ok  # [BLOCK_T, ROW_PAD]
    dst = slots[:, None] * ROW + cols[None, :]
    if FP8:
        k = _quantize_e4m3(k, k_inv_scale)
        v = _quantize_e4m3(v, v_inv_scale)
    tl.store(k_cache_ptr + dst, k, mask=store)
    tl.store(v_cache_ptr + dst, v, mask=store)


def _check(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert key.shape == value.shape and key.shape[1:] == (num_kv_heads, head_dim), (key.shape, k_cache.shape)
    assert k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    assert key.dtype == value.dtype and (key.dtype == k_cache.dtype or k_cache.dtype == FP8_DTYPE), \
        (key.dtype, k_cache.dtype)
    for t in (key, value):  # a token's heads must be one contiguous row (a view of qkv is fine)
        assert t.stride(2) == 1 and t.stride(1) == head_dim, t.stride()


def kv_append(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [>= num_tokens] int32/int64, -1 = skip
    k_scale: float = 1.0,  # fp8 cache only: stored = key / k_scale
    v_scale: float = 1.0,
) -> None:
    """Write key/value[t] to cache slot slot_mapping[t] for every token t (one launch)."""
    _check(key, value, k_cache, v_cache)
    launch_kv_append(key, value, k_cache, v_cache, slot_mapping, TOKENS_PER_PROGRAM, NUM_WARPS, k_scale, v_scale)


def launch_kv_append(key, value, k_cache, v_cache, slot_mapping, tokens_per_program: int, num_warps: int,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The launch itself, with the tile shape as arguments (the benchmark sweeps them)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    _kv_append_kernel[(triton.cdiv(num_tokens, tokens_per_program),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens, key.stride(0), value.stride(0), 1.0 / k_scale,
        1.0 / v_scale, ROW=row, ROW_PAD=triton.next_power_of_2(row), BLOCK_T=tokens_per_program,
        FP8=k_cache.dtype == FP8_DTYPE, num_warps=num_warps,
    )


def quantize_fp8_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch reference of the kernel's fp8 store: clamp(x * (1 / scale) in fp32, +-448) cast to e4m3."""
    inv = torch.tensor(1.0 / scale, dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def kv_append_reference(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> None:
    """Torch reference: index_copy of the non-padding rows (host sync on the mask); an fp8
    cache gets quantize_fp8_reference of them."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping[: key.shape[0]].long()
    valid = slots >= 0
    key, value, slots = key[valid], value[valid], slots[valid]
    if k_cache.dtype == FP8_DTYPE:  # index_copy_ has no fp8 CPU kernel: copy the bytes
        key, value = quantize_fp8_reference(key, k_scale).view(torch.uint8), \
            quantize_fp8_reference(value, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, value)


def kv_append_index_put_baseline(key, value, k_cache, v_cache, slot_mapping) -> None:
    """The torch way the kernel replaces: build the index of real tokens, index_select
    their rows and scatter them with index_put_ (several launches and a host sync)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping[: key.shape[0]]
    rows = torch.nonzero(slots >= 0).squeeze(1)  # [num_real_tokens]
    dst = slots.index_select(0, rows).long()
    k_cache.view(-1, num_kv_heads, head_dim).index_put_((dst,), key.index_select(0, rows))
    v_cache.view(-1, num_kv_heads, head_dim).index_put_((dst,), value.index_select(0, rows))
