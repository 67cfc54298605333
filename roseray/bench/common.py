"""Shared pieces of the benchmarks: percentiles, result files, tables."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch


def percentiles(values, qs=(50, 95, 99)) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def resolve_loop(loop: str) -> str:
    """"auto" -> "uvloop" when it is installed (as uvicorn's loop="auto" picks), else "asyncio"."""
    if loop == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return loop


def new_runner(loop: str = "auto") -> asyncio.Runner:
    """An asyncio.Runner on the named event loop ("asyncio", "uvloop" or "auto"): one loop
    for several runs (an engine started on it stays bound to it)."""
    if resolve_loop(loop) == "uvloop":
        import uvloop  # optional: only when asked for or installed

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()})"


def write_result(path: str | None, name: str, result: dict) -> Path | None:
    if not path:
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "device": device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "torch": torch.__version__, **result}
    out.write_text(json.dumps(payload, indent=2))
    return out


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 24))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
