"""Fused-MoE kernel benchmark at the Qwen3-30B-A3B expert shape (128 experts, top-8, hidden 2048,
intermediate 768) on CUDA.

    python -m roseray.bench kernels --moe [--moe-tokens 1,64,8192] [--sweep] [--sweep-seconds S] [--out f.json]

Per token count T: roseray_kernels.fused_moe (the public call with its host launches, and its device
time in a CUDA graph for decode-sized steps) against moe_reference (the per-expert torch loop the CPU
runs), on the same random routing. Decode steps stream expert weights: GB/s counts the weight bytes of
the experts the step touches, against the copy bandwidth measured in the same run. Large steps compute:
TFLOP/s counts 6 T k H I (gate_up 2 T k H 2I + down 2 T k I H) against the dense-GEMM ceiling, torch.matmul
of the same FLOPs ([T k, H] x [H, 2I] and [T k, I] x [I, H]) timed here; %dense is the fraction reached.
The stage columns are device times of the two align methods (always in a CUDA graph: a few tiny launches,
whose host launch time would swamp them) and of each GEMM alone; align_% is the Triton align's share of
align + both GEMMs.
--sweep times the tile shapes of each GEMM at a few T (device time for small T) and prints the best
against the TILE_TABLE default, for choosing roseray_kernels.fused_moe's table.
"""

from __future__ import annotations

import json
import math
import platform
import time

import torch
import triton

from roseray.bench.kernel_timing import Row, bench_copy, graph_us, median_us, try_time
from roseray.layers.moe import ExpertActivation, moe_reference, route
from roseray_kernels.fused_moe import GemmTile, choose_tiles, fused_moe, moe_gemm
from roseray_kernels.moe_align import moe_align

SHAPE = dict(num_experts=128, top_k=8, hidden=2048, inter=768)  # Qwen3-30B-A3B's experts
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
GRAPH_MAX_TOKENS = 512  # device time in a CUDA graph up to here (launch gaps would dominate); events above
GRAPH_REPEATS = 20
# block_m tried per token count (a T between keys takes the next smaller key's); also the default sweep's T
SWEEP_BLOCK_M = {1: (16,), 8: (16,), 64: (16, 32), 256: (16, 32, 64), 1024: (32, 64, 128), 4096: (64, 128),
                 8192: (64, 128)}
GATE_UP_TILES = (GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 4), GemmTile(64, 64, 4, 4), GemmTile(64, 64, 4, 3),
                 GemmTile(128, 64, 8, 3), GemmTile(64, 128, 8, 3), GemmTile(32, 256, 4, 3), GemmTile(128, 64, 4, 3))
DOWN_TILES = (GemmTile(64, 128, 4, 4), GemmTile(128, 64, 4, 4), GemmTile(64, 64, 4, 4), GemmTile(128, 64, 8, 3),
              GemmTile(32, 128, 4, 4), GemmTile(128, 128, 8, 3), GemmTile(256, 64, 8, 3), GemmTile(64, 256, 4, 3))


class Experts:
    """Random bf16/fp16 expert weights of SHAPE and one random step per token count."""

    def __init__(self, dtype, device) -> None:
        e, h, i = SHAPE["num_experts"], SHAPE["hidden"], SHAPE["inter"]
        self.dtype, self.device = dtype, device
        self.w13 = (torch.randn(e, 2 * i, h, device=device) * 0.02).to(dtype)
        self.w2 = (torch.randn(e, h, i, device=device) * 0.02).to(dtype)

    def step(self, num_tokens: int):
        hidden = torch.randn(num_tokens, SHAPE["hidden"], device=self.device, dtype=self.dtype)
        logits = torch.randn(num_tokens, SHAPE["num_experts"], device=self.device)
        weights, ids = route(logits, SHAPE["top_k"], renormalize=True)
        return hidden, weights, ids


def device_us(fn, num_tokens: int) -> float:
    return graph_us(fn, GRAPH_REPEATS) if num_tokens <= GRAPH_MAX_TOKENS else median_us(fn)


def dense_ceiling_us(num_tokens: int, dtype, device) -> float:
    """torch.matmul of the fused MoE's FLOPs as two dense GEMMs (one weight matrix each)."""
    rows, h, i = num_tokens * SHAPE["top_k"], SHAPE["hidden"], SHAPE["inter"]
    a1, b1 = torch.randn(rows, h, device=device, dtype=dtype), torch.randn(h, 2 * i, device=device, dtype=dtype)
    a2, b2 = torch.randn(rows, i, device=device, dtype=dtype), torch.randn(i, h, device=device, dtype=dtype)
    o1, o2 = torch.empty(rows, 2 * i, device=device, dtype=dtype), torch.empty(rows, h, device=device, dtype=dtype)

    def dense():
        torch.matmul(a1, b1, out=o1)
        torch.matmul(a2, b2, out=o2)

    return device_us(dense, num_tokens)


def bench_moe(experts: Experts, tokens, copy_bw: float) -> list[Row]:
    rows = []
    k, h, i = SHAPE["top_k"], SHAPE["hidden"], SHAPE["inter"]
    silu = ExpertActivation("silu")
    for num_tokens in tokens:
        hidden, weights, ids = experts.step(num_tokens)
        tiles = choose_tiles(num_tokens, k, SHAPE["num_experts"])
        fused = lambda: fused_moe(hidden, experts.w13, experts.w2, weights, ids, "silu")  # noqa: E731
        reference = lambda: moe_reference(hidden, experts.w13, experts.w2, weights, ids, silu)  # noqa: E731
        us, ref_us = median_us(fused), median_us(reference)
        dev_us = device_us(fused, num_tokens)
        touched = int(ids.unique().numel())
        weight_bytes = touched * 3 * h * i * experts.w13.element_size()
        flops = 6.0 * num_tokens * k * h * i
        dense_us = dense_ceiling_us(num_tokens, experts.dtype, experts.device)
        tflops, dense_tflops = flops / (dev_us * 1e-6) / 1e12, flops / (dense_us * 1e-6) / 1e12

        aligned = moe_align(ids, SHAPE["num_experts"], tiles.block_m)
        activated = moe_gemm(hidden, experts.w13, None, aligned, tiles.gate_up, top_k=k, gated=True)
        flat_weights = weights.reshape(-1)
        stages = {
            "align_triton_us": graph_us(lambda: moe_align(ids, SHAPE["num_experts"], tiles.block_m, "triton"),
                                        GRAPH_REPEATS),
            "align_torch_us": graph_us(lambda: moe_align(ids, SHAPE["num_experts"], tiles.block_m, "torch"),
                                       GRAPH_REPEATS),
            "gate_up_us": device_us(lambda: moe_gemm(hidden, experts.w13, None, aligned, tiles.gate_up, top_k=k,
                                                     gated=True), num_tokens),
            "down_us": device_us(lambda: moe_gemm(activated, experts.w2, None, aligned, tiles.down, top_k=1,
                                                  gated=False, route_weights=flat_weights), num_tokens),
        }
        stages["align_%"] = 100 * stages["align_triton_us"] / (stages["align_triton_us"] + stages["gate_up_us"]
                                                                + stages["down_us"])
        rows.append(Row(f"fused MoE T={num_tokens}", us, {
            "block_m": tiles.block_m, "device_us": dev_us, "reference_us": ref_us, "speedup": ref_us / us,
            "experts": touched, "weight_GB/s": weight_bytes / (dev_us * 1e-6) / 1e9,
            "%copy": 100 * weight_bytes / (dev_us * 1e-6) / copy_bw, "TFLOP/s": tflops,
            "dense_TFLOP/s": dense_tflops, "%dense": 100 * tflops / dense_tflops, **stages}))
    return rows


def table(rows: list[Row]) -> str:
    columns = ("block_m", "device_us", "reference_us", "speedup", "experts", "weight_GB/s", "%copy", "TFLOP/s",
               "dense_TFLOP/s", "%dense", "align_triton_us", "align_torch_us", "gate_up_us", "down_us",
               "align_%")
    header = f"{'T':>6} {'call_us':>9} " + " ".join(f"{c:>{max(8, len(c))}}" for c in columns)
    lines = [header]
    for row in rows:
        cells = [f"{row.extra[c]:>{max(8, len(c))}.4g}" for c in columns]
        lines.append(f"{row.name.split('=')[1]:>6} {row.us:9.2f} " + " ".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Tile sweep
# ---------------------------------------------------------------------------------------
def tile_label(tile: GemmTile) -> str:
    return f"n{tile.block_n} k{tile.block_k} w{tile.num_warps} s{tile.num_stages} g{tile.group_m}"


def sweep_moe(experts: Experts, tokens, deadline: float) -> list[Row]:
    """Each GEMM alone over its candidate tiles and block_m per T; then the best of each against
    the default (choose_tiles)."""
    rows, summary = [], []
    k = SHAPE["top_k"]
    for num_tokens in tokens:
        hidden, weights, ids = experts.step(num_tokens)
        default = choose_tiles(num_tokens, k, SHAPE["num_experts"])
        flat_weights = weights.reshape(-1)
        results = {"gate_up": [], "down": []}
        nearest = max([t for t in SWEEP_BLOCK_M if t <= num_tokens] or [min(SWEEP_BLOCK_M)])
        for block_m in sorted(set(SWEEP_BLOCK_M[nearest]) | {default.block_m}):
            aligned = moe_align(ids, SHAPE["num_experts"], block_m)
            activated = torch.randn(ids.numel(), SHAPE["inter"], device=experts.device, dtype=experts.dtype)
            for gemm, candidates, default_tile in (("gate_up", GATE_UP_TILES, default.gate_up),
                                                   ("down", DOWN_TILES, default.down)):
                for tile in dict.fromkeys(candidates + (default_tile,)):
                    if time.time() > deadline:
                        return rows + summary + [Row("sweep stopped at its deadline", 0.0)]
                    if gemm == "gate_up":
                        fn = lambda a=aligned, t=tile: moe_gemm(hidden, experts.w13, None, a, t, top_k=k,  # noqa: E731
                                                                gated=True)
                    else:
                        fn = lambda a=aligned, t=tile: moe_gemm(activated, experts.w2, None, a, t, top_k=1,  # noqa: E731
                                                                gated=False, route_weights=flat_weights)
                    row = try_time(f"sweep moe {gemm} T={num_tokens} m{block_m} {tile_label(tile)}", fn,
                                   lambda us: {}, graph=num_tokens <= GRAPH_MAX_TOKENS)
                    rows.append(row)
                    is_default = block_m == default.block_m and tile == default_tile
                    results[gemm].append((row.us, block_m, tile, is_default))
        for gemm, timed in results.items():
            ok = [r for r in timed if not math.isnan(r[0])]
            if not ok:
                continue
            best = min(ok, key=lambda r: r[0])
            default_us = next((r[0] for r in ok if r[3]), float("nan"))
            summary.append(Row(f"sweep best {gemm} T={num_tokens}: m{best[1]} {tile_label(best[2])}", best[0],
                               {"default_us": default_us, "default/best": default_us / best[0]}))
    return rows + summary


# ---------------------------------------------------------------------------------------
# Entry point (from roseray.bench.kernels --moe)
# ---------------------------------------------------------------------------------------
def run(dtype_name: str, tokens_arg: str, sweep: bool, sweep_seconds: float, out: str | None) -> int:
    device, dtype = torch.device("cuda"), getattr(torch, dtype_name)
    tokens = tuple(int(t) for t in tokens_arg.split(",")) if tokens_arg else TOKENS
    torch.manual_seed(0)
    copy_row, copy_bw = bench_copy(device)
    experts = Experts(dtype, device)
    rows = bench_moe(experts, tokens, copy_bw)
    sweep_tokens = tokens if tokens_arg else tuple(SWEEP_BLOCK_M)
    sweep_rows = sweep_moe(experts, sweep_tokens, time.time() + sweep_seconds) if sweep else []
    if sweep_rows:
        print("\n".join(r.text() for r in sweep_rows))
    print(f"\nroseray fused MoE on {torch.cuda.get_device_name(0)}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"torch {torch.__version__}, triton {triton.__version__}, {dtype_name}, experts {SHAPE}")
    print(copy_row.text())
    print(table(rows))
    if out:
        payload = {"benchmark": "kernels-moe", "device": torch.cuda.get_device_name(0),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
                   "triton": triton.__version__, "python": platform.python_version(), "dtype": dtype_name,
                   "shape": SHAPE, "rows": [{"name": r.name, "us": r.us, **r.extra}
                                            for r in [copy_row] + rows + sweep_rows]}
        with open(out, "w") as f:
            json.dump(payload, f, indent=2)
    return 0
