"""FP8 linear layers against bf16 at Llama-3.1-8B's projection shapes on CUDA.

    python -m roseray.bench kernels --fp8 [--fp8-rows 1,64,256] [--sweep] [--out f.json]

Per row count M (decode batch or prefill chunk): the device time (in a CUDA graph, so host launch
gaps do not count) of one decoder layer's four projections (q|k|v, o, gate|up, down) in bf16
(torch's F.linear, cuBLAS) and through roseray_kernels.fp8_gemm.fp8_linear (the path it picks for
M), and each fp8 path alone: the weight-streaming W8A16 Triton kernel, the per-token quantize
+ cuBLASLt row-wise fp8 GEMM (W8A8), and the same quantize + roseray's fp8 x fp8 Triton kernel
(W8A8 Triton), and the per-token quantization of the four inputs alone (what the W8A8 paths pay
before their GEMMs). The W8A16_MAX_ROWS crossover is read from these.
--sweep times W8A16 tile shapes at SWEEP_ROWS rows and W8A8 Triton tiles at SWEEP_W8A8_ROWS,
and prints the best against the default.
"""

from __future__ import annotations

import json
import platform
import time

import torch

from roseray.bench.kernel_timing import graph_us
from roseray_kernels.fp8_gemm import (
    W8A8_TILE,
    W8A16_MAX_ROWS,
    W8A16Tile,
    choose_w8a16_tile,
    fp8_linear,
    fp8_w8a8,
    fp8_w8a8_triton,
    fp8_w8a16,
)
from roseray_kernels.fp8_quant import quantize_per_channel, quantize_per_token

LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 4096)
SWEEP_ROWS = (1, 16)
SWEEP_W8A8_ROWS = (32, 64, 128, 256)
SWEEP_W8A8_TILES = (W8A8_TILE, W8A16Tile(64, 64, 128, 4, 4), W8A16Tile(64, 128, 128, 4, 3),
                    W8A16Tile(64, 128, 256, 8, 3), W8A16Tile(128, 128, 128, 8, 3), W8A16Tile(32, 64, 128, 4, 4),
                    W8A16Tile(64, 256, 128, 8, 3))
SWEEP_TILES = tuple(W8A16Tile(m, n, k, w, s) for m in (16, 32) for n in (16, 32, 64) for k in (128, 256)
                    for w, s in ((4, 3), (4, 4)))


def _layer_us(fn_per_shape, weights, rows, device) -> float:
    total = 0.0
    for name, (_, k) in LLAMA_8B.items():
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        total += graph_us(lambda x=x, name=name: fn_per_shape(x, weights[name]), repeats=20)
    return total


def run(rows_csv: str, sweep: bool, out: str | None) -> int:
    if not torch.cuda.is_available():
        print("the fp8 benchmark needs a CUDA device")
        return 2
    device = torch.device("cuda")
    rows_list = [int(r) for r in rows_csv.split(",")] if rows_csv else list(ROWS)
    weights = {}
    for name, (n, k) in LLAMA_8B.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        weights[name] = (w, *quantize_per_channel(w))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  W8A16_MAX_ROWS={W8A16_MAX_ROWS}")
    print(f"{'rows':>5} {'bf16 us':>9} {'fp8 us':>9} {'speedup':>8} {'w8a16 us':>9} {'w8a8 us':>9} "
          f"{'w8a8-triton us':>14} {'quantize us':>11}  (one Llama-8B layer)")
    results = []
    for rows in rows_list:
        bf16 = _layer_us(lambda x, w: torch.nn.functional.linear(x, w[0]), weights, rows, device)
        fp8 = _layer_us(lambda x, w: fp8_linear(x, w[1], w[2]), weights, rows, device)
        w8a16 = _layer_us(lambda x, w: fp8_w8a16(x, w[1], w[2]), weights, rows, device)
        w8a8 = _layer_us(lambda x, w: fp8_w8a8(x, w[1], w[2].view(1, -1)), weights, rows, device)
        w8a8_triton = _layer_us(lambda x, w: fp8_w8a8_triton(x, w[1], w[2]), weights, rows, device)
        quantize = _layer_us(lambda x, w: quantize_per_token(x), weights, rows, device)
        results.append(dict(rows=rows, bf16_us=bf16, fp8_us=fp8, w8a16_us=w8a16, w8a8_us=w8a8,
                            w8a8_triton_us=w8a8_triton, quantize_us=quantize))
        print(f"{rows:5d} {bf16:9.1f} {fp8:9.1f} {bf16 / fp8:8.2f} {w8a16:9.1f} {w8a8:9.1f} {w8a8_triton:14.1f} "
              f"{quantize:11.1f}")
    if sweep:
        _sweep(weights, SWEEP_ROWS, device)
        _sweep_w8a8(weights, device)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "host": platform.node(), "time": time.time(),
                       "rows": results}, f, indent=1)
    return 0


def _sweep(weights, rows_list, device) -> None:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print("W8A16 tiles: best per (rows, shape) against the default")
    for rows in rows_list:
        for name, (n, k) in LLAMA_8B.items():
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            _, q, s = weights[name]
            default = choose_w8a16_tile(rows, n, sms)
            timed = {}
            for tile in {default, *SWEEP_TILES}:
                if tile.block_m < min(rows, 16) or tile.block_m > max(16, 2 * rows):
                    continue
                try:
                    timed[tile] = graph_us(lambda tile=tile: fp8_w8a16(x, q, s, tile=tile), repeats=20)
                except Exception:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
                    continue
            best = min(timed, key=timed.get)
            print(f"  rows {rows:4d} {name:8} default {timed[default]:7.1f} us {default}  "
                  f"best {timed[best]:7.1f} us {best}")


def _sweep_w8a8(weights, device) -> None:
    print("W8A8 Triton tiles (quantize included): best per (rows, shape) against the default")
    for rows in SWEEP_W8A8_ROWS:
        for name, (_, k) in LLAMA_8B.items():
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            _, q, s = weights[name]
            timed = {}
            for tile in SWEEP_W8A8_TILES:
                try:
                    timed[tile] = graph_us(lambda tile=tile: fp8_w8a8_triton(x, q, s, tile=tile), repeats=20)
                except Exception:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
                    continue
            best = min(timed, key=timed.get)
            cublas = graph_us(lambda: fp8_w8a8(x, q, s.view(1, -1)), repeats=20)
            default = timed.get(W8A8_TILE, float("nan"))
            print(f"  rows {rows:4d} {name:8} cuBLASLt {cublas:7.1f} us  default {default:7.1f} us  "
                  f"best {timed[best]:7.1f} us {best}")
