"""Linear layers: a fused projection of several outputs (q|k|v, gate|up), and the strict
copying of checkpoint tensors into a model's parameters (every parameter filled exactly
once, any unknown or missing tensor a clear error)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from typing import NamedTuple

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input; the output is their
    concatenation in `output_sizes` order. Checkpoints load each part as a shard."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.offsets = [0, *itertools.accumulate(output_sizes)]

    def checkpoint_shards(self, leaf: str) -> range:
        return range(len(self.output_sizes))

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of `param` (weight [out, in] or bias [out]) that hold output `index`."""
        return param.data.narrow(0, self.offsets[index], self.output_sizes[index])


class WeightEntry(NamedTuple):
    """A checkpoint tensor and where it goes: parameter name and, for a MergedLinear, the shard."""

    checkpoint_name: str
    param_name: str
    shard: Hashable | None  # a key of the owner's checkpoint_shards(), None = the whole parameter
    tensor: torch.Tensor


def load_weight_entries(model: nn.Module, entries: Iterable[WeightEntry]) -> None:
    """Copy every entry into its parameter (with dtype/device conversion); raise ValueError on
    an unknown name, a shape mismatch or a parameter the checkpoint never filled."""
    params = dict(model.named_parameters())
    expected = {target for name in params for target in _targets(model, name)}
    loaded: set[tuple[str, Hashable]] = set()
    for entry in entries:
        if entry.param_name not in params or (entry.param_name, entry.shard) not in expected:
            raise ValueError(f"unexpected weight {entry.checkpoint_name!r} in checkpoint for {type(model).__name__}")
        dest = params[entry.param_name].data
        owner = _owner(model, entry.param_name)
        if entry.shard is not None:
            dest = owner.shard(dest, entry.shard)
        tensor = entry.tensor
        # a module that keeps part of a checkpoint tensor (a tensor-parallel shard) or reshapes it
        # (a per-tensor fp8 scale filling its rows): adapt_checkpoint_tensor(leaf, shard, tensor, shape)
        adapt = getattr(owner, "adapt_checkpoint_tensor", None)
        if adapt is not None:
            tensor = adapt(entry.param_name.rpartition(".")[2], entry.shard, tensor, dest.shape)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {entry.checkpoint_name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)} (does config.json match the checkpoint?)"
            )
        dest.copy_(tensor)
        loaded.add((entry.param_name, entry.shard))
    missing = sorted(name + ("" if shard is None else f"[shard {shard}]") for name, shard in expected - loaded)
    if missing:
        raise ValueError(
            f"checkpoint is missing {len(missing)} weight(s) of {type(model).__name__}: {', '.join(missing[:8])}"
        )


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def _targets(model: nn.Module, param_name: str) -> list[tuple[str, Hashable]]:
    """The (parameter, shard) pairs a checkpoint must fill: a module that loads a parameter
    in parts (MergedLinear, an MoE layer's per-expert weights) names them with
    `checkpoint_shards(parameter_leaf_name)` and cuts them with `shard(param, key)`."""
    owner = _owner(model, param_name)
    shards = getattr(owner, "checkpoint_shards", None)
    if shards is None:
        return [(param_name, None)]
    return [(param_name, key) for key in shards(param_name.rpartition(".")[2])]
