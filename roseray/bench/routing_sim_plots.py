"""The routing simulator's plot (matplotlib, Agg backend): TTFT p90 against offered QPS, a line
per policy, one PNG per (workload, replica count)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def plot_ttft_p90(rows: list[dict], plot_dir: str, model_label: str = "provisional step-time model") -> list[Path]:
    """TTFT p90 against offered QPS, a line per policy; one PNG per (workload, replicas).
    `model_label` names the step-time model in the title."""
    paths = []
    for workload, replicas in sorted({(r["workload"], r["replicas"]) for r in rows}):
        fig, ax = plt.subplots(figsize=(7, 5))
        mine = [r for r in rows if r["workload"] == workload and r["replicas"] == replicas]
        for policy in dict.fromkeys(r["policy"] for r in mine):
            points = sorted((r["qps"], r["ttft_p90_s"]) for r in mine if r["policy"] == policy)
            ax.plot([q for q, _ in points], [t for _, t in points], marker="o", label=policy)
        ax.set_yscale("log")
        ax.set_xlabel("offered QPS")
        ax.set_ylabel("TTFT p90 (s)")
        ax.set_title(f"{workload}, {replicas} replicas (simulated, {model_label})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        path = Path(plot_dir) / f"routing_sim_{workload}_{replicas}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths
