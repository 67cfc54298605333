"""A linear layer with fp8 (e4m3) weights and one fp32 scale per output channel.

    y = x @ (weight * weight_scale[:, None]).T + bias

It is made two ways:
- `Fp8Linear.from_linear(linear)`: a bf16/fp16/fp32 layer quantized at load (per channel);
- `Fp8Linear.shell_like(linear, scale_format)`: empty, to be filled from an fp8 checkpoint.
  Per-tensor and per-channel checkpoint scales become per-channel ones as they load (a
  per-tensor scale of q, k or v fills that part's rows); 128x128 block scales
  (`weight_scale_inv`) load as they are and `finalize()` turns them into per-channel ones
  (dequantize, requantize per row: one GEMM path for every format).
On CUDA the matmul runs roseray_kernels.fp8_gemm.fp8_linear; elsewhere the dequantized
reference (CPU tests run the same loading code and numerics up to the kernel). Both come through
roseray.layers.fused: fp8 needs the kernel package, i.e. Triton (Linux).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable

import torch
from torch import nn

from roseray.layers import fused

FP8_DTYPE = torch.float8_e4m3fn

# how a checkpoint stores weight scales: one per tensor (or per q/k/v part), one per output row,
# or one per block of rows x columns
SCALE_FORMATS = ("tensor", "channel", "block")


@torch.no_grad()
def requantize_blocks_per_channel(weight: torch.Tensor, scale_inv: torch.Tensor,
                                  block_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight [N, K] with block scales [ceil(N/r), ceil(K/c)] -> (e4m3 [N, K], fp32 scale [N]):
    dequantized, then requantized with one scale per row (the one fp8 GEMM form roseray runs)."""
    rows, cols = block_size
    n, k = weight.shape
    scale = scale_inv.float().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return fused.quantize_per_channel(weight.float() * scale)


def per_row_scale(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A checkpoint's weight scale as the per-row vector of `shape`: a per-tensor scale (a scalar
    or [1]) fills every row, a per-channel [rows, 1] one is flattened."""
    if len(shape) == 1:
        if tensor.numel() == 1:
            return tensor.reshape(()).float().expand(shape)
        if tensor.dim() == 2 and tensor.shape[1] == 1:
            return tensor.reshape(-1)
    return tensor


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, bias_dtype: torch.dtype,
                 output_sizes: list[int] | None = None, scale_format: str = "channel",
                 block_size: tuple[int, int] | None = None, device: torch.device | None = None) -> None:
        super().__init__()
        assert scale_format in SCALE_FORMATS and (scale_format == "block") == (block_size is not None)
        self.in_features, self.out_features = in_features, out_features
        self.output_sizes = list(output_sizes or [out_features])
        self.offsets = [0, *itertools.accumulate(self.output_sizes)]
        self.scale_format, self.block_size = scale_format, block_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        if block_size is not None:
            rows, cols = -(-out_features // block_size[0]), -(-in_features // block_size[1])
            for size in self.offsets:
                if size % block_size[0]:
                    raise ValueError(f"fp8 block scales of {block_size[0]} rows do not divide the projection "
                                     f"sizes {self.output_sizes}")
            self.weight_scale_inv = nn.Parameter(torch.empty(rows, cols, dtype=torch.float32, device=device),
                                                 requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device), requires_grad=False)
                     if bias else None)

    # ------------------------------------------------------------ construction

    @classmethod
    def shell_like(cls, linear: nn.Linear, scale_format: str, block_size: tuple[int, int] | None = None) -> Fp8Linear:
        return cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                   bias_dtype=linear.weight.dtype, output_sizes=getattr(linear, "output_sizes", None),
                   scale_format=scale_format, block_size=block_size, device=linear.weight.device)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        layer = cls.shell_like(linear, "channel")
        layer.weight.data, layer.weight_scale.data = fused.quantize_per_channel(linear.weight)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias)
        return layer

    @torch.no_grad()
    def finalize(self) -> None:
        """After loading: block scales -> per-channel scales (nothing to do for the others)."""
        if self.block_size is None:
            return
        self.weight.data, self.weight_scale.data = requantize_blocks_per_channel(
            self.weight, self.weight_scale_inv, self.block_size)
        del self.weight_scale_inv
        self.block_size, self.scale_format = None, "channel"

    # ------------------------------------------------------------ checkpoint loading protocol (linear.py)

    def checkpoint_shards(self, leaf: str) -> list[Hashable]:
        if leaf == "weight_scale" and self.block_size is not None:
            return []  # computed by finalize()
        return list(range(len(self.output_sizes))) if len(self.output_sizes) > 1 else [None]

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        start, size = self.offsets[index], self.output_sizes[index]
        if param.dim() == 2 and param.shape[0] != self.out_features:  # block scales: a row per block of rows
            start, size = start // self.block_size[0], -(-size // self.block_size[0])
        return param.narrow(0, start, size)

    def adapt_checkpoint_tensor(self, leaf: str, shard: Hashable, tensor: torch.Tensor,
                                shape: torch.Size) -> torch.Tensor:
        """A per-tensor scale fills its rows; a [rows, 1] per-channel scale is a vector."""
        return per_row_scale(tensor, shape) if leaf == "weight_scale" else tensor

    # ------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K], or the rows its norm quantized already (fused.QuantizedRows: the kernel path)."""
        if isinstance(x, fused.QuantizedRows) or x.is_cuda:
            return fused.fp8_linear(x, self.weight, self.weight_scale, self.bias)
        return fused.fp8_linear_reference(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
