"""Kernel microbenchmarks: KV append and paged attention (Triton) on CUDA; the fused MoE with --moe
(roseray.bench.kernels_moe); fp8 linear layers against bf16 with --fp8 (roseray.bench.kernels_fp8).

    python -m roseray.bench kernels [--out results.json] [--sweep]
    python -m roseray.bench kernels --moe [--moe-tokens 1,64,8192] [--sweep] [--out results.json]
    python -m roseray.bench kernels --fp8 [--fp8-rows 1,64,256] [--sweep] [--out results.json]
    python -m roseray.bench kernels --kv-cache-dtype fp8   # the attention kernels over an e4m3 cache
    python -m roseray.bench.kernels ...

Times are medians of triton.testing.do_bench (CUDA events). Bandwidth counts the bytes a
kernel must move: KV append reads and writes every K/V row of the step; decode attention
reads every cached K/V byte of every sequence (queries and outputs are not counted).
Percentages are of the H100 copy bandwidth of BENCHMARKS.md (3.02 TB/s, read + write)
and of the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass

import torch
import triton

from roseray.bench import kernels_fp8, kernels_moe
from roseray.bench.kernel_timing import Row, bandwidth, bench_copy, graph_us, median_us, rotating, try_time
from roseray.config import KV_CACHE_DTYPES
from roseray.layers.kv_fp8 import kv_cache_dtype_name, kv_cache_torch_dtype
from roseray_kernels import kv_append, kv_append_index_put_baseline, paged_attention
from roseray_kernels.kv_append import TOKENS_PER_PROGRAM, launch_kv_append
from roseray_kernels.paged_attention import (
    DECODE_CONFIG,
    DECODE_MHA_CONFIG,
    PREFILL_CONFIG,
    KernelConfig,
    _launch_decode,
    _launch_general,
    choose_num_splits,
)

QWEN3 = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16)  # Qwen3-0.6B attention
GPT2 = dict(num_heads=12, num_kv_heads=12, head_dim=64, block_size=16)  # GPT-2 (MHA: the dot-free decode)
GPT2_BATCH = 128  # the W-seed benchmark: 128 sequences decoding, contexts 1..129
GPT2_CACHE_BLOCKS = 16384  # 400 MB each for K and V in bf16: rotating input sets miss the 50 MB L2
GPT2_INPUT_SETS = 4
CACHE_BLOCKS = 3 * 16384  # per layer-cache tensor: 1.5 GiB each for K and V in bf16
KV_APPEND_TOKENS = (64, 256, 8192, 32768)
DECODE_CASES = ((256, 1024), (64, 1024), (1, 32768), (4, 16384), (16, 8192), (64, 4096))  # (batch, context)
DECODE_WINDOW_CASES = ((64, 8192, 1024), (4, 32768, 4096))  # (batch, context, sliding window)
PREFILL_CASES = {  # name: (cached prefix, query_len) per sequence
    "prefill 4 x 2048 fresh": [(0, 2048)] * 4,
    "prefill chunks 8 x 512 over 3584 cached": [(3584, 512)] * 8,
    "mixed 256 decodes (ctx 1024) + 1 chunk 512": [(1023, 1)] * 256 + [(0, 512)],
}


@triton.jit
def _empty_kernel(x_ptr):
    pass


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------
# The cache dtype of the run (--kv-cache-dtype): None = the model dtype, else torch.float8_e4m3fn.
KV_CACHE_DTYPE: torch.dtype | None = None


def make_cache(num_blocks: int, dtype, device, geometry=QWEN3):
    shape = (num_blocks, geometry["block_size"], geometry["num_kv_heads"], geometry["head_dim"])
    cache_dtype = KV_CACHE_DTYPE or dtype
    return tuple(torch.randn(shape, dtype=dtype, device=device).to(cache_dtype) for _ in range(2))


@dataclass
class DecodeBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    qsl: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int
    kv_bytes: int
    flops: float


def make_batch(k_cache, seqs, dtype, device, num_heads: int = QWEN3["num_heads"]) -> DecodeBatch:
    """seqs: (cached prefix, query_len) per sequence; blocks are a random permutation.
    The geometry (block size, KV heads, head_dim) is the cache's."""
    _, bs, hkv, d = k_cache.shape
    lens = [c + q for c, q in seqs]
    need = [triton.cdiv(n, bs) for n in lens]
    assert sum(need) <= k_cache.shape[0], "cache too small"
    ids = torch.randperm(k_cache.shape[0], device=device)[: sum(need)].int()
    tables = torch.zeros((len(seqs), max(need)), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[start: start + n]
        start += n
    qlens = [q for _, q in seqs]
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    query = torch.randn(sum(qlens), num_heads, d, dtype=dtype, device=device)
    kv_bytes = sum(lens) * hkv * d * k_cache.element_size() * 2
    # QK^T and PV over the keys each query sees (causal within the chunk).
    visible = sum(q * c + q * (q + 1) // 2 for c, q in seqs)
    flops = 4.0 * visible * num_heads * d
    return DecodeBatch(query, qsl, torch.tensor(lens, dtype=torch.int32, device=device), tables, max(qlens),
                       kv_bytes, flops)


def attend(batch: DecodeBatch, k_cache, v_cache, max_seq_len: int, num_splits=None, **options):
    return lambda: paged_attention(batch.query, k_cache, v_cache, batch.qsl, batch.seq_lens, batch.tables,
                                   QWEN3["head_dim"] ** -0.5, batch.max_query_len, max_seq_len, num_splits=num_splits,
                                   **options)


# ---------------------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------------------
def bench_empty(device) -> list[Row]:
    x = torch.empty(1, device=device)
    launch = lambda: _empty_kernel[(1,)](x)  # noqa: E731
    return [Row("empty Triton kernel launch", median_us(launch)),
            Row("empty Triton kernel, device time in a CUDA graph", graph_us(launch))]


def bench_kv_append(k_cache, v_cache, copy_bw, empty_us, dtype, device) -> list[Row]:
    """The public kv_append (argument checks included) against the index_put baseline."""
    rows = []
    hkv, d = QWEN3["num_kv_heads"], QWEN3["head_dim"]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    for num_tokens in KV_APPEND_TOKENS:
        sets = 4 if num_tokens >= 8192 else 1
        inputs = []
        for _ in range(sets):
            qkv = torch.randn(num_tokens, 3, hkv, d, dtype=dtype, device=device)  # K, V as views of fused qkv
            slots = torch.randperm(num_slots, device=device)[:num_tokens].int()
            inputs.append((qkv[:, 1], qkv[:, 2], slots))
        triton_fn = rotating([lambda a=a: kv_append(a[0], a[1], k_cache, v_cache, a[2]) for a in inputs])
        nbytes = 2 * num_tokens * hkv * d * (k_cache.element_size() + qkv.element_size()) + num_tokens * 4
        us = median_us(triton_fn)
        extra = {"x_empty": us / empty_us}
        if k_cache.dtype == dtype:  # the torch baseline copies, it does not quantize
            base_us = median_us(rotating([lambda a=a: kv_append_index_put_baseline(a[0], a[1], k_cache, v_cache, a[2])
                                          for a in inputs]))
            extra.update(baseline_us=base_us, speedup=base_us / us)
        extra.update(bandwidth(nbytes, us, copy_bw))
        into = "" if k_cache.dtype == dtype else f" -> {kv_cache_dtype_name(k_cache.dtype)}"
        rows.append(Row(f"kv_append {num_tokens} tokens (Qwen3, {str(dtype)[6:]}{into})", us, extra))
        if num_tokens <= 256:
            g_us = graph_us(lambda a=inputs[0]: kv_append(a[0], a[1], k_cache, v_cache, a[2]))
            rows.append(Row(f"kv_append {num_tokens} tokens, device time in a CUDA graph", g_us, {}))
    return rows


def bench_decode(k_cache, v_cache, copy_bw, dtype, device) -> list[Row]:
    rows = []
    for batch_size, ctx in DECODE_CASES:
        batch = make_batch(k_cache, [(ctx - 1, 1)] * batch_size, dtype, device)
        auto = choose_num_splits(batch_size, QWEN3["num_kv_heads"], ctx, device)
        us = median_us(attend(batch, k_cache, v_cache, ctx))
        extra = {"splits": auto, **bandwidth(batch.kv_bytes, us, copy_bw)}
        if auto > 1:
            extra["us_1split"] = median_us(attend(batch, k_cache, v_cache, ctx, num_splits=1))
        rows.append(Row(f"decode attention batch {batch_size} x ctx {ctx}", us, extra))
        if (batch_size, ctx) == (256, 1024):
            hint = median_us(attend(batch, k_cache, v_cache, 40960))
            rows.append(Row("  same, max_seq_len hint 40960 (graph capture)", hint,
                            bandwidth(batch.kv_bytes, hint, copy_bw)))
            g_us = graph_us(attend(batch, k_cache, v_cache, 40960), repeats=10)
            rows.append(Row("  same, device time in a CUDA graph", g_us, bandwidth(batch.kv_bytes, g_us, copy_bw)))
    return rows


def bench_decode_window(k_cache, v_cache, copy_bw, dtype, device) -> list[Row]:
    """Decode of a sliding layer against the same batch without a window: only the window's blocks are
    read, so the time follows the window (bandwidth counts the window's K/V bytes)."""
    rows = []
    for batch_size, ctx, window in DECODE_WINDOW_CASES:
        batch = make_batch(k_cache, [(ctx - 1, 1)] * batch_size, dtype, device)
        full_us = median_us(attend(batch, k_cache, v_cache, ctx))
        us = median_us(attend(batch, k_cache, v_cache, ctx, sliding_window=window))
        rows.append(Row(f"decode attention batch {batch_size} x ctx {ctx}, window {window}", us,
                        {"us_no_window": full_us, **bandwidth(batch.kv_bytes * window / ctx, us, copy_bw)}))
    return rows


def gpt2_decode_cases(dtype, device) -> tuple[torch.Tensor, torch.Tensor, dict[str, list[DecodeBatch]]]:
    """GPT-2 decode at the W-seed geometry (batch 128, 12 heads of 64, block 16): a cache of its
    own and, per context case, GPT2_INPUT_SETS batches over different blocks (rotated: no L2 reuse)."""
    k_cache, v_cache = make_cache(GPT2_CACHE_BLOCKS, dtype, device, GPT2)
    contexts = {"ctx 64": [64] * GPT2_BATCH, "ctx 128": [128] * GPT2_BATCH,
                "ctx 1..128": [1 + i % 128 for i in range(GPT2_BATCH)]}  # the W-seed spread
    cases = {name: [make_batch(k_cache, [(n - 1, 1) for n in lens], dtype, device, GPT2["num_heads"])
                    for _ in range(GPT2_INPUT_SETS)]
             for name, lens in contexts.items()}
    return k_cache, v_cache, cases


def gpt2_decode_fn(batches: list[DecodeBatch], k_cache, v_cache, cfg: KernelConfig | None):
    """Decode over the rotating batches with `cfg` (None: paged_attention's own choice)."""
    scale = GPT2["head_dim"] ** -0.5
    outs = [torch.empty_like(b.query) for b in batches]
    if cfg is None:
        return rotating([lambda b=b, o=o: paged_attention(b.query, k_cache, v_cache, b.qsl, b.seq_lens, b.tables,
                                                          scale, 1, 1024, out=o) for b, o in zip(batches, outs)])
    return rotating([lambda b=b, o=o: _launch_decode(b.query, k_cache, v_cache, o, b.qsl, b.seq_lens, b.tables,
                                                     scale, 1, cfg) for b, o in zip(batches, outs)])


def bench_decode_gpt2(gpt2, copy_bw) -> list[Row]:
    """Device time in a CUDA graph (a few us a call: launch gaps would dominate median_us)."""
    k_cache, v_cache, cases = gpt2
    rows = []
    for name, batches in cases.items():
        us = graph_us(gpt2_decode_fn(batches, k_cache, v_cache, None))
        rows.append(Row(f"decode attention GPT-2 batch {GPT2_BATCH} x {name} (graph)", us,
                        bandwidth(batches[0].kv_bytes, us, copy_bw)))
    return rows


def bench_prefill(k_cache, v_cache, copy_bw, dtype, device) -> list[Row]:
    rows = []
    for name, seqs in PREFILL_CASES.items():
        batch = make_batch(k_cache, seqs, dtype, device)
        us = median_us(attend(batch, k_cache, v_cache, max(c + q for c, q in seqs)))
        tflops = batch.flops / (us * 1e-6) / 1e12
        rows.append(Row(name, us, {"TFLOP/s": tflops, **bandwidth(batch.kv_bytes, us, copy_bw)}))
    return rows


# ---------------------------------------------------------------------------------------
# Sweeps (tile shapes; the defaults in roseray_kernels come from these)
# ---------------------------------------------------------------------------------------
SWEEP_PARTS = ("decode", "decode_mha", "splits", "prefill", "kv_append")
SPLIT_CASES = ((1, 32768), (4, 16384), (16, 8192), (64, 1024))


def sweep(k_cache, v_cache, copy_bw, empty_us, dtype, device, deadline: float, parts=SWEEP_PARTS,
          gpt2=None) -> list[Row]:
    rows = []
    args = (k_cache, v_cache, copy_bw, empty_us, dtype, device, deadline)
    for part in parts:
        if part == "decode_mha":
            rows += sweep_decode_mha(gpt2, copy_bw, deadline)
        else:
            rows += {"decode": sweep_decode_tiles, "splits": sweep_splits, "prefill": sweep_prefill_tiles,
                     "kv_append": sweep_kv_append}[part](*args)
        if time.time() > deadline:
            return rows + [Row("sweep stopped at its deadline", 0.0)]
    return rows


def sweep_decode_tiles(k_cache, v_cache, copy_bw, empty_us, dtype, device, deadline) -> list[Row]:
    rows = []
    scale = QWEN3["head_dim"] ** -0.5
    decode = make_batch(k_cache, [(1023, 1)] * 256, dtype, device)
    out = torch.empty_like(decode.query)
    for block_n in (32, 64, 128):
        for num_warps in (2, 4, 8):
            for num_stages in (2, 3, 4):
                if time.time() > deadline:
                    return rows + [Row("sweep stopped at its deadline", 0.0)]
                cfg = KernelConfig(block_n, num_warps, num_stages)
                fn = lambda cfg=cfg: _launch_decode(decode.query, k_cache, v_cache, out, decode.qsl,  # noqa: E731
                                                    decode.seq_lens, decode.tables, scale, 1, cfg)
                rows.append(try_time(f"sweep decode 256x1024 n{block_n} w{num_warps} s{num_stages}", fn,
                                 lambda us: bandwidth(decode.kv_bytes, us, copy_bw)))
    return rows


# GPT-2 decode tiles: (block_n, num_warps, num_stages, use_dot). tl.dot tiles of 16 rows (one used)
# against the dot-free kernel (num_stages does not change its code: it is not pipelined).
MHA_DECODE_SHAPES = ([(64, 4, 3, True), (32, 4, 2, True), (32, 2, 1, True), (64, 2, 2, True)]
                     + [(n, w, 1, False) for n in (16, 32, 64, 128) for w in (1, 2, 4, 8)])


def sweep_decode_mha(gpt2, copy_bw, deadline) -> list[Row]:
    """DECODE_MHA_CONFIG: each shape at the GPT-2 W-seed geometry, device time in a CUDA graph."""
    k_cache, v_cache, cases = gpt2
    rows = []
    for block_n, num_warps, num_stages, use_dot in MHA_DECODE_SHAPES:
        cfg = KernelConfig(block_n, num_warps, num_stages, use_dot=use_dot)
        for name, batches in cases.items():
            if time.time() > deadline:
                return rows + [Row("sweep stopped at its deadline", 0.0)]
            tag = "dot" if use_dot else "dot-free"
            label = f"sweep decode GPT-2 {GPT2_BATCH} x {name} {tag} n{block_n} w{num_warps} s{num_stages}"
            rows.append(try_time(label, gpt2_decode_fn(batches, k_cache, v_cache, cfg),
                                 lambda us, b=batches[0]: bandwidth(b.kv_bytes, us, copy_bw), graph=True))
    return rows


def sweep_splits(k_cache, v_cache, copy_bw, empty_us, dtype, device, deadline) -> list[Row]:
    rows = []
    for batch_size, ctx in SPLIT_CASES:
        batch = make_batch(k_cache, [(ctx - 1, 1)] * batch_size, dtype, device)
        for splits in (1, 2, 4, 8, 16, 32, 64, 128):
            if splits * 256 > ctx or time.time() > deadline:
                continue
            rows.append(try_time(f"sweep decode {batch_size}x{ctx} splits {splits}",
                             attend(batch, k_cache, v_cache, ctx, num_splits=splits),
                             lambda us, b=batch: bandwidth(b.kv_bytes, us, copy_bw)))
    return rows


def sweep_prefill_tiles(k_cache, v_cache, copy_bw, empty_us, dtype, device, deadline) -> list[Row]:
    rows = []
    scale = QWEN3["head_dim"] ** -0.5
    prefill = make_batch(k_cache, [(3584, 512)] * 8, dtype, device)
    pout = torch.empty_like(prefill.query)
    shapes = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2),
              (128, 64, 8, 3), (128, 32, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2))
    for block_m, block_n, num_warps, num_stages in shapes:
        if time.time() > deadline:
            return rows + [Row("sweep stopped at its deadline", 0.0)]
        cfg = KernelConfig(block_n, num_warps, num_stages, block_m)
        fn = lambda cfg=cfg: _launch_general(prefill.query, k_cache, v_cache, pout, prefill.qsl,  # noqa: E731
                                             prefill.seq_lens, prefill.tables, scale, cfg)
        rows.append(try_time(f"sweep prefill 8x512/3584 m{block_m} n{block_n} w{num_warps} s{num_stages}", fn,
                         lambda us: {"TFLOP/s": prefill.flops / (us * 1e-6) / 1e12}))
    return rows


def sweep_kv_append(k_cache, v_cache, copy_bw, empty_us, dtype, device, deadline) -> list[Row]:
    rows = []
    hkv, d = QWEN3["num_kv_heads"], QWEN3["head_dim"]
    for num_tokens in (256, 8192):
        qkv = torch.randn(num_tokens, 3, hkv, d, dtype=dtype, device=device)
        slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1], device=device)[:num_tokens].int()
        nbytes = 2 * num_tokens * hkv * d * (k_cache.element_size() + qkv.element_size())
        for block_t in (1, 2, 4, 8):
            for num_warps in (1, 2, 4, 8):
                if time.time() > deadline:
                    return rows + [Row("sweep stopped at its deadline", 0.0)]
                fn = lambda bt=block_t, nw=num_warps: launch_kv_append(qkv[:, 1], qkv[:, 2], k_cache, v_cache,  # noqa: E731
                                                                      slots, bt, nw)
                graph = num_tokens <= 256  # small steps: device time in a graph (launch cost is the same for all)
                name = f"sweep kv_append {num_tokens} t{block_t} w{num_warps}" + (" (graph)" if graph else "")
                rows.append(try_time(name, fn, lambda us: bandwidth(nbytes, us, copy_bw), graph=graph))
    return rows


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.bench kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--sweep", nargs="?", const=",".join(SWEEP_PARTS), default="",
                        help=f"also sweep tile shapes / split counts: comma list of {','.join(SWEEP_PARTS)} "
                             "(default all)")
    parser.add_argument("--sweep-seconds", type=float, default=150.0, help="stop the sweep after this long")
    parser.add_argument("--moe", action="store_true", help="the fused-MoE benchmark (Qwen3-30B-A3B experts) instead "
                        "of the attention kernels; with --sweep, its tile sweep")
    parser.add_argument("--moe-tokens", default="", help="--moe: comma list of token counts (default 1..8192)")
    parser.add_argument("--fp8", action="store_true", help="fp8 against bf16 linear layers at Llama-8B's shapes "
                        "instead of the attention kernels; with --sweep, the W8A16 tile sweep")
    parser.add_argument("--fp8-rows", default="", help="--fp8: comma list of row counts (default 1..4096)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the attention kernels' cache: auto = --dtype, fp8 = e4m3 (queries stay --dtype)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel benchmarks need a CUDA device", file=sys.stderr)
        return 2
    if args.fp8:
        return kernels_fp8.run(args.fp8_rows, bool(args.sweep), args.out)
    if args.moe:
        return kernels_moe.run(args.dtype, args.moe_tokens, bool(args.sweep), args.sweep_seconds, args.out)
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    torch.manual_seed(0)
    global KV_CACHE_DTYPE
    KV_CACHE_DTYPE = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)

    copy_row, copy_bw = bench_copy(device)
    rows = [copy_row] + bench_empty(device)
    empty_us = rows[1].us
    k_cache, v_cache = make_cache(CACHE_BLOCKS, dtype, device)
    rows += bench_kv_append(k_cache, v_cache, copy_bw, empty_us, dtype, device)
    rows += bench_decode(k_cache, v_cache, copy_bw, dtype, device)
    rows += bench_decode_window(k_cache, v_cache, copy_bw, dtype, device)
    gpt2 = gpt2_decode_cases(dtype, device)
    rows += bench_decode_gpt2(gpt2, copy_bw)
    rows += bench_prefill(k_cache, v_cache, copy_bw, dtype, device)
    if args.sweep:
        parts = [p for p in args.sweep.split(",") if p]
        unknown = set(parts) - set(SWEEP_PARTS)
        if unknown:
            parser.error(f"unknown sweep parts {sorted(unknown)}; choose from {SWEEP_PARTS}")
        sweep_rows = sweep(k_cache, v_cache, copy_bw, empty_us, dtype, device, time.time() + args.sweep_seconds, parts,
                           gpt2)
        print("\n".join(r.text() for r in sweep_rows))
        rows += sweep_rows

    print(f"\nroseray kernels on {torch.cuda.get_device_name(0)}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, KV cache "
          f"{kv_cache_dtype_name(KV_CACHE_DTYPE)}")
    print(f"defaults: decode {DECODE_CONFIG}, MHA decode {DECODE_MHA_CONFIG}, prefill {PREFILL_CONFIG}, "
          f"kv_append {TOKENS_PER_PROGRAM} token(s)/program")
    print("\n".join(r.text() for r in rows if not r.name.startswith("sweep")))
    if args.out:
        payload = {"benchmark": "kernels", "device": torch.cuda.get_device_name(0),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                   "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
                   "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                   "rows": [{"name": r.name, "us": r.us, **r.extra} for r in rows]}
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
