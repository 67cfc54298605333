"""Normalisation layers: RMSNorm (Llama family) computed in fp32 like Hugging Face, and
LayerNorm (GPT-2), each with the residual add of the decoder layer fused in
(`norm(x, residual) -> (out, x + residual)`).

On CUDA one Triton kernel does the add and the norm; elsewhere the torch code below does,
op by op as Hugging Face does (it is also the kernel's test oracle).

Under tensor parallelism the add+RMSNorm after a row-parallel block can take the block's
all-reduce too (`RMSNorm.all_reduce_add`): one launch with the triton all-reduce method, else the
all-reduce and then the add+norm above, the very ops of an all-reduce in the block.
"""

from __future__ import annotations

import torch
from torch import nn

from roseray.distributed import all_reduce, all_reduce_add_rmsnorm
from roseray.layers import fused


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the statistics in fp32, over the last dim.

    `forward(x)` -> y; `forward(x, residual)` -> (y of x + residual, x + residual): the
    "add then norm" of a pre-norm decoder layer in one step.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden_size]
        # the weight shape of the one Fp8Linear that reads this norm's output (set at load,
        # roseray.models.fp8_checkpoint.link_fp8_norms): where that layer would quantize the rows
        # itself, this norm's launch does it (fused.QuantizedRows)
        self.fp8_consumer: tuple[int, int] | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused.use_triton(x):
            if self.fp8_consumer is not None and x.dim() == 2 and \
                    fused.takes_quantized_rows(x.shape[0], x.dtype, self.fp8_consumer):
                return self._quantized(x, residual)
            return fused.rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def all_reduce_add(self, partial: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward(all_reduce(partial), residual)`, for the norm after a row-parallel block whose output
        is still this rank's partial sums: one launch where the group's all-reduce fuses the add and the
        norm (roseray.distributed.all_reduce_add_rmsnorm), else exactly those two steps (on one rank the
        all-reduce is nothing: forward(partial, residual))."""
        fused_result = all_reduce_add_rmsnorm(partial, residual, self.weight, self.eps)
        if fused_result is not None:
            return fused_result
        return self.forward(all_reduce(partial), residual)

    def _quantized(self, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            return fused.QuantizedRows(*fused.rmsnorm_fp8(x, self.weight, self.eps), x.dtype)
        (q, scale), residual = fused.rmsnorm_fp8(x, self.weight, self.eps, residual)
        return fused.QuantizedRows(q, scale, x.dtype), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * xf.to(input_dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm over the last dim (its weight and bias, so loaders and initialisers treat it
    as one), with the residual add fused like RMSNorm's:
    `forward(x, residual)` -> (LayerNorm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)  # weight, bias: [hidden_size]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused.use_triton(x):
            return fused.layernorm(x, self.weight, self.bias, self.eps, residual)
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x
