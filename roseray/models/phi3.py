"""Phi-3 (Phi-3-mini/medium, Phi-3.5-mini): the Llama decoder with q|k|v and gate|up already
fused in the checkpoint, an optional sliding window on every layer (like Mistral) and
LongRoPE scaling for the long-context variants (roseray.layers.rotary: the long or the short
factors are chosen once, by the model's context length).

The checkpoint's `qkv_proj` and `gate_up_proj` have the layout of roseray's MergedLinear
(q rows, then k, then v; gate rows, then up), so loading hands each one over as its shards:
the whole checkpoint part each, which a tensor-parallel rank then narrows to its own rows
(roseray.layers.tensor_parallel.ColumnParallelLinear).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from roseray.layers.linear import WeightEntry
from roseray.layers.tensor_parallel import ColumnParallelLinear
from roseray.models.hf_fields import decoder_geometry, layer_types, rope
from roseray.models.llama import LlamaForCausalLM

# config.json rope types older transformers wrote for LongRoPE
_LONGROPE_ALIASES = ("su", "yarn")


class Phi3ForCausalLM(LlamaForCausalLM):
    def _entries(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightEntry]:
        for entry in super()._entries(weights):
            owner_name, _, leaf = entry.param_name.rpartition(".")
            owner = self._module(owner_name) if entry.shard is None else None
            if not isinstance(owner, ColumnParallelLinear):
                yield entry
                continue
            sizes = [part.full for part in owner.parts]  # the checkpoint's rows of each part
            if entry.tensor.shape[0] != sum(sizes):
                raise ValueError(f"weight {entry.checkpoint_name!r} has shape {tuple(entry.tensor.shape)}, "
                                 f"expected {sum(sizes)} rows (does config.json match the checkpoint?)")
            for index, part in enumerate(entry.tensor.split(sizes)):
                yield WeightEntry(entry.checkpoint_name, entry.param_name, index, part)

    def _module(self, name: str) -> nn.Module | None:
        try:
            return self.get_submodule(name)
        except AttributeError:
            return None  # an unknown name: load_weight_entries reports it


def _rope_fields(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling, LongRoPE's older names mapped to "longrope" and its original
    context length taken from the top level of config.json first (as transformers does)."""
    hf = dict(hf)
    for key in ("rope_scaling", "rope_parameters"):
        params = hf.get(key)
        if params and params.get("rope_type", params.get("type")) in _LONGROPE_ALIASES:
            hf[key] = {**params, "rope_type": "longrope"}
            hf[key].pop("type", None)
    theta, scaling = rope(hf)
    if scaling is not None and scaling["rope_type"] == "longrope":
        original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or hf["max_position_embeddings"]
        for key in ("short_factor", "long_factor"):
            if not scaling.get(key):
                raise ValueError(f"longrope rope_scaling without {key} is unsupported")
    return theta, scaling


def config_fields(hf: dict[str, Any], hf_architecture: str) -> dict[str, Any]:
    """ModelConfig fields from a Phi-3 config.json."""
    num_layers = hf["num_hidden_layers"]
    max_positions = hf["max_position_embeddings"]
    rope_theta, rope_scaling = _rope_fields(hf)
    window = hf.get("sliding_window")
    if window is not None and window >= max_positions:  # wider than any sequence: no window at all
        window = None
    return dict(
        **decoder_geometry(hf),
        hidden_act=hf.get("hidden_act", "silu"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=window,
        layer_types=layer_types({}, num_layers, window),  # every layer (transformers reads no layer_types)
    )
