"""Activation functions by their Hugging Face names, and the gated form of SwiGLU MLPs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from roseray.layers import fused


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,  # GPT-2's tanh approximation
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


class GatedActivation(nn.Module):
    """act(gate) * up, where the input is the concatenation [gate | up] along the last dim.
    SiLU and GELU-tanh on CUDA are one fused Triton kernel (roseray_kernels.activation)."""

    def __init__(self, name: str = "silu") -> None:
        super().__init__()
        self.act = get_activation(name)
        self.fused_name = "silu" if self.act is F.silu else "gelu_tanh" if self.act is _gelu_tanh else None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_name is not None and gate_up.dim() == 2 and fused.use_triton(gate_up):
            kernel = fused.silu_and_mul if self.fused_name == "silu" else fused.gelu_tanh_and_mul
            return kernel(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # each [num_tokens, intermediate_size]
        return self.act(gate) * up
