"""Timing helpers of the kernel microbenchmarks (roseray.bench.kernels and kernels_moe): medians
of triton.testing.do_bench (CUDA events), device time inside a CUDA graph, and result rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton.testing

H100_COPY_BW = 3.02e12  # bytes/s, read + written (BENCHMARKS.md)
GRAPH_REPEATS = 50  # launches per captured graph when timing device time without launch gaps


@dataclass
class Row:
    name: str
    us: float
    extra: dict = field(default_factory=dict)

    def text(self) -> str:
        bits = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.extra.items()]
        return f"{self.name:<58} {self.us:10.2f} us   " + "  ".join(bits)


def median_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def graph_us(fn, repeats: int = GRAPH_REPEATS) -> float:
    """Device time per call without host launch gaps: `repeats` calls captured in one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return median_us(graph.replay) / repeats


def rotating(fns):
    """One callable that cycles through several input sets (keeps L2 from serving repeats)."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(fns)
        fns[state["i"]]()

    return call


def bandwidth(nbytes: float, us: float, copy_bw: float) -> dict:
    bw = nbytes / (us * 1e-6)
    return {"GB/s": bw / 1e9, "%3.02TB/s": 100 * bw / H100_COPY_BW, "%copy": 100 * bw / copy_bw}


def bench_copy(device) -> tuple[Row, float]:
    src = torch.randn(2**28, dtype=torch.bfloat16, device=device)  # 512 MiB
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    bw = 2 * src.numel() * src.element_size() / (us * 1e-6)
    return Row("device-to-device copy 512 MiB", us, {"GB/s": bw / 1e9}), bw


def try_time(name, fn, extra_of, graph=False) -> Row:
    try:
        us = graph_us(fn) if graph else median_us(fn)
        return Row(name, us, extra_of(us))
    except Exception as exc:  # a tile shape that does not compile or fit is a result too
        return Row(name, float("nan"), {"error": type(exc).__name__ + ": " + str(exc)[:80]})
