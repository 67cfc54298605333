"""The report's PNG plots (matplotlib, Agg backend: no display needed).

itl_cdf.png: the CDF of ITL per replica and over all replicas (left), and the same as a
tail plot, 1 - CDF on log axes (right), where p99 and p99.9 are readable.
itl_over_time.png: every ITL sample against the time it was observed (a random subset
when there are very many) with the p50 and p99 of each time bin, per replica.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
import numpy as np  # noqa: E402

MAX_POINTS_PER_REPLICA = 50_000


def _floor(series: list[np.ndarray]) -> float:
    """Where gaps of 0 (chunks that arrived in one read) are drawn on a log axis: half the
    smallest positive gap."""
    positive = [v[v > 0].min() for v in series if (v > 0).any()]
    return 0.5 * min(positive) if positive else 1e-3


def _label(name: str, values: np.ndarray) -> str:
    p50, p99 = np.percentile(values, [50, 99])
    zeros = int(np.sum(values == 0))
    zero_note = f", {zeros} gaps of 0 at the left edge" if zeros else ""
    return f"{name} (n={values.size}, p50 {p50:.2f} ms, p99 {p99:.2f} ms{zero_note})"


def plot_itl_cdf(itl_ms: dict[str, np.ndarray], path: str | Path, title: str) -> Path:
    fig, (ax_cdf, ax_tail) = plt.subplots(1, 2, figsize=(14, 5.5))
    series = {name: np.sort(v) for name, v in itl_ms.items() if v.size}
    if len(series) > 1:
        series["all replicas"] = np.sort(np.concatenate(list(series.values())))
    floor = _floor(list(series.values()))
    for name, v in series.items():
        cdf = np.arange(1, v.size + 1) / v.size
        style = {"color": "black", "linestyle": "--", "linewidth": 1.2} if name == "all replicas" else {}
        x = np.maximum(v, floor)
        ax_cdf.plot(x, cdf, label=_label(name, v), drawstyle="steps-post", **style)
        tail = 1.0 - cdf + 1.0 / v.size  # >0 for the log axis: the last sample sits at 1/n
        ax_tail.plot(x, tail, drawstyle="steps-post", **style)
    for ax in (ax_cdf, ax_tail):
        ax.set_xscale("log")
        ax.set_xlabel("inter-token latency per content chunk (ms)")
        ax.grid(True, which="both", alpha=0.3)
    ax_cdf.set_ylabel("CDF")
    ax_cdf.set_ylim(0, 1.001)
    ax_tail.set_yscale("log")
    ax_tail.set_ylabel("1 - CDF (tail)")
    for q, y in (("p99", 1e-2), ("p99.9", 1e-3)):
        ax_tail.axhline(y, color="grey", linewidth=0.8, linestyle=":")
        ax_tail.annotate(q, (0.01, y), xycoords=("axes fraction", "data"), fontsize=8, color="grey",
                         va="bottom")
    if series:
        ax_cdf.legend(fontsize=8, loc="lower right")
    else:
        ax_cdf.text(0.5, 0.5, "no ITL samples", ha="center", transform=ax_cdf.transAxes)
    fig.suptitle(f"ITL CDF per replica — {title}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_itl_over_time(itl_ms: dict[str, np.ndarray], itl_at: dict[str, np.ndarray], start: float,
                       path: str | Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(14, 5.5))
    rng = np.random.default_rng(0)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ends = [float(t.max()) for t in itl_at.values() if t.size]
    duration = max(ends) - start if ends else 0.0
    bin_s = max(1.0, duration / 120)
    floor = _floor(list(itl_ms.values()))
    for i, name in enumerate(sorted(itl_ms)):
        v, t = np.maximum(itl_ms[name], floor), itl_at[name] - start
        if not v.size:
            continue
        color = colors[i % len(colors)]
        pick = rng.choice(v.size, MAX_POINTS_PER_REPLICA, replace=False) if v.size > MAX_POINTS_PER_REPLICA \
            else slice(None)
        ax.scatter(t[pick], v[pick], s=4, alpha=0.5 if v.size < 5000 else 0.2, color=color, rasterized=True,
                   linewidths=0)
        bins = np.floor(t / bin_s).astype(np.int64)
        order = np.argsort(bins, kind="stable")
        sorted_bins, sorted_v = bins[order], v[order]
        edges = np.flatnonzero(np.diff(sorted_bins)) + 1
        centers, p50, p99 = [], [], []
        for lo, hi in zip(np.r_[0, edges], np.r_[edges, sorted_v.size]):
            centers.append((sorted_bins[lo] + 0.5) * bin_s)
            q50, q99 = np.percentile(sorted_v[lo:hi], [50, 99])
            p50.append(q50)
            p99.append(q99)
        ax.plot(centers, p99, color=color, linewidth=1.6, label=f"{name} p99 per {bin_s:.0f} s")
        ax.plot(centers, p50, color=color, linewidth=1.0, linestyle="--", label=f"{name} p50")
    ax.set_yscale("log")
    ax.set_xlabel("time since the start of measurement (s)")
    ax.set_ylabel("inter-token latency per content chunk (ms)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    else:
        ax.text(0.5, 0.5, "no ITL samples", ha="center", transform=ax.transAxes)
    ax.set_title(f"ITL over time — {title}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
