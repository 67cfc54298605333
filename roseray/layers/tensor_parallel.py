"""Layers sharded across a tensor-parallel group (roseray.distributed), loaded from whole
checkpoint tensors: each rank keeps its slice as the tensor loads (the `adapt_checkpoint_tensor`
hook of roseray.layers.linear), so a rank never holds more than its share.

- ColumnParallelLinear: a fused projection (q|k|v, gate|up) whose every part keeps 1/N of its
  output rows. KV heads split across ranks; with fewer KV heads than ranks each rank keeps the
  one KV head its query heads read (replicated across the ranks that share it).
- RowParallelLinear: 1/N of the input columns; the caller all-reduces its output (the bias is
  loaded on rank 0 only, so the sum adds it once).
- VocabParallelEmbedding / VocabParallelLMHead: 1/N of the (padded) vocabulary rows; embedding
  lookups of other ranks' rows are zeros, summed by an all-reduce; logits are all-gathered.
At N = 1 the projections are exactly MergedLinear and nn.Linear (the models use the plain
embedding and lm_head then), so single-GPU models are unchanged.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from roseray.distributed import TensorParallel, all_gather_last, all_reduce
from roseray.layers.linear import MergedLinear
from roseray.layers.vocab import VOCAB_PADDING, padded_vocab_size


@dataclass(frozen=True)
class PartShard:
    """This rank's rows [start, start + local) of a projection part's `full` checkpoint rows."""

    full: int
    start: int
    local: int


def split_part(full: int, tp: TensorParallel, what: str) -> PartShard:
    local = tp.split(full, what)
    return PartShard(full, tp.rank * local, local)


def kv_head_part(num_kv_heads: int, head_dim: int, tp: TensorParallel) -> PartShard:
    """K or V rows of this rank: its share of the KV heads, or (fewer heads than ranks) the one
    head its query heads use."""
    if num_kv_heads >= tp.size:
        return split_part(num_kv_heads * head_dim, tp, "KV heads")
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp.size} is not a multiple of the model's {num_kv_heads} KV heads")
    head = tp.rank * num_kv_heads // tp.size
    return PartShard(num_kv_heads * head_dim, head * head_dim, head_dim)


class ColumnParallelLinear(MergedLinear):
    def __init__(self, in_features: int, parts: list[PartShard], bias: bool = False) -> None:
        super().__init__(in_features, [p.local for p in parts], bias=bias)
        self.parts = parts

    def adapt_checkpoint_tensor(self, leaf: str, shard: Hashable, tensor: torch.Tensor,
                                shape: torch.Size) -> torch.Tensor:
        part = self.parts[shard]
        if part.local != part.full and tensor.shape[0] == part.full:
            return tensor.narrow(0, part.start, part.local)
        return tensor


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, bias: bool = False,
                 what: str = "projection input") -> None:
        self.shard = split_part(in_features, tp, what)
        super().__init__(self.shard.local, out_features, bias=bias)
        self.rank = tp.rank

    def adapt_checkpoint_tensor(self, leaf: str, shard: Hashable, tensor: torch.Tensor,
                                shape: torch.Size) -> torch.Tensor:
        if leaf == "weight" and tensor.shape[1] == self.shard.full != self.shard.local:
            return tensor.narrow(1, self.shard.start, self.shard.local)
        if leaf == "bias" and self.rank != 0:
            return torch.zeros_like(tensor)
        return tensor


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary (padded to a multiple of VOCAB_PADDING x N, zeros past it)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.local = padded_vocab_size(vocab_size, VOCAB_PADDING * tp.size) // tp.size
        self.start = tp.rank * self.local
        self.weight = nn.Parameter(torch.zeros(self.local, hidden_size), requires_grad=False)

    def adapt_checkpoint_tensor(self, leaf: str, shard: Hashable, tensor: torch.Tensor,
                                shape: torch.Size) -> torch.Tensor:
        rows = tensor[self.start: self.start + self.local]
        if rows.shape[0] < self.local:
            rows = torch.cat([rows, rows.new_zeros(self.local - rows.shape[0], rows.shape[1])])
        return rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.local)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        return all_reduce(out.masked_fill_(~inside[:, None], 0.0))


class VocabParallelLMHead(VocabParallelEmbedding):
    """The output projection over this rank's vocabulary rows; `logits` gathers all ranks'."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last(F.linear(hidden, self.weight))[:, : self.vocab_size]
