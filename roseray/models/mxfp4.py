"""MXFP4 checkpoint tensors (OCP microscaling FP4), dequantized at load.

A quantized matrix `W [..., rows, cols]` is stored as two uint8 tensors:
- `blocks [..., rows, cols / 32, 16]`: two FP4 (e2m1) codes per byte, the element at an even
  column in the low nibble and the next one in the high nibble;
- `scales [..., rows, cols / 32]`: one e8m0 exponent per group of 32 consecutive columns of a
  row, the group's factor being 2 ** (scale - 127).

Every FP4 value times a power of two is exact in bf16 and fp32, so dequantizing loses nothing.
gpt-oss's released checkpoints store their expert matrices this way (`*_blocks`, `*_scales`).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32  # values sharing one scale
SCALE_BIAS = 127
# e2m1 code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., groups, 16] uint8, scales [..., groups] uint8 -> [..., groups * 32] in `dtype`,
    on the blocks' device. Callers bound the memory by passing a slice (e.g. one expert)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., groups, {GROUP_SIZE // 2}] and scales [..., groups])")  # fmt: skip
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)  # [..., groups, 16, 2]: even column, then odd
    values = table[codes.long()].flatten(-3)  # [..., groups, 32] -> [..., groups * 32] below
    values = values.view(*scales.shape, GROUP_SIZE)
    exponents = scales.to(torch.int32) - SCALE_BIAS  # [..., groups]
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)

