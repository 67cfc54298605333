"""Shared by the kernel tests."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
