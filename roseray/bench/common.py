"""Shared pieces of the benchmarks: percentiles, result files, tables."""

from __future__ import annotations

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
