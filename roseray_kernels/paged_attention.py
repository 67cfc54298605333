"""Paged attention through block tables: prefill chunks (cached prefix + causal part) and decode.

The layer appends the step's K/V to the cache first, so every key a query may see is read
from the cache through its sequence's block table. Sequence i owns query rows
`query_start_loc[i] : query_start_loc[i + 1]`, the last `query_len` of its `seq_lens[i]`
tokens. GQA: the query heads that share one KV head are packed into the rows of one
tile, so each K/V tile is read once per KV head. Softmax runs online in fp32 (base 2).

Two launch shapes, both CUDA-graph capturable (grids from shapes and python ints only;
lengths read from device memory; no host syncs):
- decode (`max_query_len == 1`): one program per (sequence, KV head, KV split). With more
  than one split (flash-decoding, for few sequences with long contexts) the partial
  results go to a workspace and a second small kernel combines them. GQA groups use tl.dot
  on tiles of >= 16 rows (the group's heads packed); MHA (GPT-2) would fill one of those 16
  rows and pay the tile's shared memory for nothing, so a group of one takes a dot-free form:
  q.k and p.v summed in the registers of the K/V tiles.
- general (prefill and mixed batches): one program per (query tile, KV head, KV split); a
  tile is BLOCK_Q tokens of one sequence (BLOCK_M rows of packed heads), found by binary
  search over query_start_loc. A large grid (long chunks, big mixed batches) runs one split:
  the single-pass kernel, no workspace, no second launch. A small one (a short chunk after a
  long cached prefix: a few dozen tiles on a GPU of 132 SMs, each walking the whole prefix)
  splits every tile's key range into S parts, S a power of two chosen from python ints only
  (the tile bound num_tokens // BLOCK_Q + num_seqs, the KV heads, the SM count and the
  max_seq_len hint, or a window's span); each split's range is computed in the kernel from
  the sequence's length, so one S serves any lengths at replay. The splits' partials are
  combined per token row by the same combine kernel as decode's (paged_attention_combine).

Layer options (each a compile-time flag of the kernels; a layer without them runs the plain
kernels): `sliding_window` (keys in (p - window, p] for a query at p; cache blocks wholly
before the window are not read), `softcap` (scores -> cap * tanh(scores / cap)) and `sinks`
(a per-head logit in every softmax's denominator; with splits it is counted once, in the
combine). The jitted code is in paged_attention_kernels and paged_attention_combine.

fp8 KV cache (torch.float8_e4m3fn, written by kv_append with per-layer k_scale / v_scale):
the kernels convert each K/V tile to the query's dtype after loading it; k_scale is folded
into the softmax scale on the host and v_scale multiplies the output once, so an fp8 cache
costs one conversion per element read. A cache in the query's dtype ignores the scales.

Padding: sequences with seq_len 0 give zero rows; rows past query_start_loc[-1] are zeroed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from .paged_attention_combine import combine_splits_kernel
from .paged_attention_kernels import decode_kernel, general_kernel

LOG2E = 1.4426950408889634
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class KernelConfig:
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    block_m: int = 16  # query rows per tile (general kernel: tokens x packed heads)
    use_dot: bool = True  # decode: tl.dot on >= 16-row tiles; False = dot-free rows in registers


# Tile shapes chosen from `python -m roseray.bench kernels --sweep` on an H100 (BENCHMARKS.md,
# "Kernel tile choices"): decode tiles of 32-128 keys with 2-4 warps are equivalent, 8 warps slower;
# 64x64 prefill tiles are near the best shape tried. These serve head_dim <= 128.
DECODE_CONFIG = KernelConfig(block_n=64, num_warps=4, num_stages=3)
# MHA decode (group of one, e.g. GPT-2's 12 heads of 64) runs without tl.dot: 32 keys x 2 warps.
DECODE_MHA_CONFIG = KernelConfig(block_n=32, num_warps=2, num_stages=1, use_dot=False)
PREFILL_CONFIG = KernelConfig(block_n=64, num_warps=4, num_stages=2, block_m=64)
# head_dim 256 (Gemma): a [64, 256] bf16 K or V tile is 32 KiB, so the head_dim-128 shapes would need
# ~200 KiB of shared memory for three decode stages and a [64, 256] fp32 prefill accumulator would
# take 128 registers a thread at 4 warps. Halved key tiles keep decode at 2 x (16 + 16) KiB staged;
# prefill keeps 64 query rows with 8 warps (64 accumulator registers a thread) and 32-key tiles; the
# dot-free MHA decode holds [16, 256] tiles in the registers of 4 warps.
DECODE_CONFIG_D256 = KernelConfig(block_n=32, num_warps=4, num_stages=2)
DECODE_MHA_CONFIG_D256 = KernelConfig(block_n=16, num_warps=4, num_stages=1, use_dot=False)
PREFILL_CONFIG_D256 = KernelConfig(block_n=32, num_warps=8, num_stages=2, block_m=64)
# Split-KV pays off only for small grids over long contexts (one long sequence); a full batch is
# already enough programs and gets slower when split.
MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256
# The general kernel's splits (a short prefill chunk after a long cached prefix): each split
# program loads its [BLOCK_M, D] query tile and writes a [BLOCK_M, D] fp32 partial, so a split
# gets at least this many keys and there are fewer of them than in decode.
MAX_GENERAL_SPLITS = 16
MIN_KEYS_PER_GENERAL_SPLIT = 256


def decode_config(group: int, head_dim: int) -> KernelConfig:
    """The decode tile shape for a GQA group size and head_dim (read at call time)."""
    if head_dim > 128:
        return DECODE_MHA_CONFIG_D256 if group == 1 else DECODE_CONFIG_D256
    return DECODE_MHA_CONFIG if group == 1 else DECODE_CONFIG


def prefill_config(head_dim: int) -> KernelConfig:
    return PREFILL_CONFIG_D256 if head_dim > 128 else PREFILL_CONFIG


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------
@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def splits_for_grid(programs: int, keys: int, num_sms: int, min_keys: int, max_splits: int) -> int:
    """KV splits for a grid of `programs` (before splitting) that each read up to `keys` keys:
    enough programs to fill the GPU twice, at least `min_keys` keys each (rounded up to a power
    of two, so few compiled variants), at most `max_splits`; 1 when the grid already fills it."""
    target = 2 * num_sms
    if programs >= target or keys <= min_keys:
        return 1
    splits = min(triton.cdiv(target, programs), triton.cdiv(keys, min_keys))
    return min(triton.next_power_of_2(splits), max_splits)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """KV splits for decode (one program per sequence and KV head before splitting)."""
    if device.type != "cuda":
        return 1
    return splits_for_grid(num_seqs * num_kv_heads, max_seq_len, _device_sms(device), MIN_TOKENS_PER_SPLIT,
                           MAX_SPLITS)


def general_tiles_bound(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Query tiles of a general launch at most (every sequence's last tile may be partial); the
    grid holds one more, for padding rows."""
    return num_tokens // block_q + num_seqs


def choose_general_splits(num_tokens: int, num_seqs: int, block_q: int, num_kv_heads: int, keys: int,
                          device: torch.device) -> int:
    """KV splits for the general kernel, from python ints only (so one choice serves a CUDA graph
    or a token bucket whatever the lengths at replay): the tile bound x KV heads against the SMs,
    `keys` an upper bound of the keys a tile reads (max_seq_len, or the window's span)."""
    if device.type != "cuda":
        return 1
    programs = general_tiles_bound(num_tokens, num_seqs, block_q) * num_kv_heads
    return splits_for_grid(programs, keys, _device_sms(device), MIN_KEYS_PER_GENERAL_SPLIT, MAX_GENERAL_SPLITS)


def split_warm_up_lengths(max_len: int) -> list[int]:
    """Key counts at which one short sequence (a decode row, or a 2-token chunk: the fewest programs)
    makes either kernel pick each split count it can pick for sequences up to max_len: the count is
    the smaller of what the grid leaves (largest for that one sequence) and keys // 256, rounded up
    to a power of two, so keys of 256 x 2^k, and max_len itself, reach them all. A warm-up running
    these compiles every variant before the first request (a count first met under load compiles
    there, for ~1 s of the step it is in)."""
    assert MIN_TOKENS_PER_SPLIT == MIN_KEYS_PER_GENERAL_SPLIT  # one ladder serves both kernels
    most = max(MAX_SPLITS, MAX_GENERAL_SPLITS)  # a power of two: the ladder's top is 256 x most
    ladder = {min(MIN_TOKENS_PER_SPLIT << k, max_len) for k in range(most.bit_length())}
    return sorted(ladder | {max(2, min(max_len, most * MIN_TOKENS_PER_SPLIT))})


def _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, query.shape)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K and V caches must share a layout"
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (query.dtype, FP8_DTYPE), (query.dtype, k_cache.dtype)
    assert query.stride(2) == 1, "query rows must be contiguous in head_dim"
    assert query_start_loc.dtype == seq_lens.dtype == block_tables.dtype == torch.int32
    assert query_start_loc.shape[0] >= seq_lens.shape[0] + 1 and block_tables.shape[0] >= seq_lens.shape[0]
    assert block_tables.stride(1) == 1


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached tokens incl. this step's
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,  # host hint only (sizes split-KV); may be the model's max length
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,  # KV splits (a power of two); None = choose from the shapes
    *,
    sliding_window: int | None = None,  # a query at position p sees keys in (p - sliding_window, p]
    softcap: float | None = None,  # scores (after scale) -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads] fp32/bf16 logits, one more term in each softmax denominator
    k_scale: float = 1.0,  # fp8 cache: key = stored * k_scale
    v_scale: float = 1.0,  # fp8 cache: value = stored * v_scale
) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its cached keys."""
    _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if out is None:
        out = torch.empty_like(query)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return out
    options = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    num_seqs, num_kv_heads, page = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    if max_query_len <= 1:
        if num_splits is None:
            keys_read = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + page)
            num_splits = choose_num_splits(num_seqs, num_kv_heads, keys_read, query.device)
        cfg = decode_config(_group(query, k_cache)[0], query.shape[2])
        _launch_decode(query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                       num_splits, cfg, **options)
    else:
        cfg = prefill_config(query.shape[2])
        block_q = _block_q(cfg, _group(query, k_cache)[1])
        if num_splits is None:
            # a tile's keys: the whole sequence, or its earliest query's window (from a block start) to its last
            span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + page + block_q)
            num_splits = choose_general_splits(num_tokens, num_seqs, block_q, num_kv_heads, span, query.device)
        _launch_general(query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                        num_splits, cfg, **options)
    return out


def _common_args(query, k_cache, out, block_tables):
    return (query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))


def _option_args(query, k_cache, scale, sliding_window, softcap, sinks, k_scale,
                 v_scale) -> tuple[torch.Tensor, tuple, dict]:
    """The layer options as kernel arguments: the sinks tensor (the query stands in when there is
    none), the runtime scalars (qk_scale, window, cap_l2, v_scale) and the constexpr flags. An fp8
    cache's k_scale joins qk_scale; any other cache leaves both scales out."""
    assert sliding_window is None or sliding_window >= 1, sliding_window
    assert softcap is None or softcap > 0, softcap
    if sinks is not None:
        assert sinks.shape == (query.shape[1],) and sinks.stride(0) == 1, (sinks.shape, query.shape)
        assert sinks.device == query.device, (sinks.device, query.device)
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    if kv_fp8:
        scale *= k_scale
    qk_scale = scale * LOG2E if softcap is None else scale / softcap  # tanh takes scores / cap
    cap_l2 = 0.0 if softcap is None else softcap * LOG2E
    flags = dict(HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
                 KV_FP8=kv_fp8)
    scalars = (qk_scale, sliding_window or 0, cap_l2, v_scale if kv_fp8 else 1.0)
    return (query if sinks is None else sinks), scalars, flags


def _group(query, k_cache) -> tuple[int, int]:
    group = query.shape[1] // k_cache.shape[2]
    return group, triton.next_power_of_2(group)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_q(cfg: KernelConfig, group_pad: int) -> int:
    """Query tokens per general tile: BLOCK_M rows of packed heads, at least 16 rows (tl.dot)."""
    return max(1, cfg.block_m // group_pad, triton.cdiv(16, group_pad))


def _split_workspace(query: torch.Tensor, out: torch.Tensor, units: int,
                     num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partials for `units` (sequences or token rows) x heads: acc [.., D] and (m, l) fp32.
    A single pass has none: `out` stands in for both (the kernel does not touch them)."""
    if num_splits == 1:
        return out, out
    num_heads, head_dim = query.shape[1], query.shape[2]
    assert num_splits > 1 and num_splits & (num_splits - 1) == 0, f"num_splits must be a power of two: {num_splits}"
    part_acc = torch.empty((units, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    part_ml = torch.empty((units, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    return part_acc, part_ml


def _launch_decode(query, k_cache, v_cache, out, qsl, seq_lens, tables, scale, num_splits, cfg: KernelConfig, *,
                   sliding_window=None, softcap=None, sinks=None, k_scale=1.0, v_scale=1.0):
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    group, group_pad = _group(query, k_cache)
    assert cfg.use_dot or group == 1, "the dot-free decode takes one query head per KV head"
    part_acc, part_ml = _split_workspace(query, out, num_seqs, num_splits)
    sinks_arg, scalars, flags = _option_args(query, k_cache, scale, sliding_window, softcap, sinks, k_scale, v_scale)
    sqt, sqh, sot, soh, stab, skb, sks, skh = _common_args(query, k_cache, out, tables)
    grid = (max(num_seqs, num_tokens), num_kv_heads, num_splits)
    decode_kernel[grid](
        query, k_cache, v_cache, out, qsl, seq_lens, tables, part_acc, part_ml, sinks_arg,
        *scalars, num_seqs, num_tokens, sqt, sqh, sot, soh, stab, skb, sks, skh,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=max(16, group_pad) if cfg.use_dot else 1,
        HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(query.dtype), USE_DOT=cfg.use_dot, **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1 and num_seqs > 0:
        combine_splits_kernel[(num_seqs, num_heads)](
            out, qsl, part_acc, part_ml, sinks_arg, num_seqs, num_heads, sot, soh,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, HAS_SINKS=flags["HAS_SINKS"], PER_TOKEN=False, num_warps=4,
        )


def _launch_general(query, k_cache, v_cache, out, qsl, seq_lens, tables, scale, num_splits, cfg: KernelConfig, *,
                    sliding_window=None, softcap=None, sinks=None, k_scale=1.0, v_scale=1.0):
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    group, group_pad = _group(query, k_cache)
    block_q = _block_q(cfg, group_pad)
    part_acc, part_ml = _split_workspace(query, out, num_tokens, num_splits)
    sinks_arg, scalars, flags = _option_args(query, k_cache, scale, sliding_window, softcap, sinks, k_scale, v_scale)
    sqt, sqh, sot, soh, stab, skb, sks, skh = _common_args(query, k_cache, out, tables)
    grid = (general_tiles_bound(num_tokens, num_seqs, block_q) + 1, num_kv_heads, num_splits)
    general_kernel[grid](
        query, k_cache, v_cache, out, qsl, seq_lens, tables, part_acc, part_ml, sinks_arg,
        *scalars, num_seqs, num_tokens, sqt, sqh, sot, soh, stab, skb, sks, skh,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(query.dtype), **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        combine_splits_kernel[(num_tokens, num_heads)](
            out, qsl, part_acc, part_ml, sinks_arg, num_seqs, num_heads, sot, soh,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, HAS_SINKS=flags["HAS_SINKS"], PER_TOKEN=True, num_warps=4,
        )
