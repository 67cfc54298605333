"""Llama-family decoders whose MLPs are sparse mixtures of experts: Qwen3-MoE (Qwen3's
attention with per-head q/k RMSNorm; MoE blocks on the layers `decoder_sparse_step` and
`mlp_only_layers` select, the dense gated MLP on the others) and Mixtral (Mistral's attention
with its optional sliding window; an MoE block, top-2 of 8 experts, on every layer).

An MoE block is a router (a bias-free Linear to one logit per expert, the model's `mlp.gate`)
and the experts of roseray.layers.moe.FusedMoE, which routes (softmax over every expert,
top-k, renormalised when the model says so) and runs the chosen experts.

Checkpoints store the experts one tensor per expert and projection (Hugging Face Hub names:
Qwen3-MoE `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight`, Mixtral
`block_sparse_moe.experts.{e}.w1|w3|w2.weight`, w1 = gate, w3 = up, w2 = down) or, as
transformers writes them with save_original_format=False, stacked per layer:
`mlp.experts.gate_up_proj` [experts, 2 * intermediate, hidden] (gate rows then up rows) and
`mlp.experts.down_proj` [experts, hidden, intermediate]. Both load into FusedMoE's stacked
`w13` / `w2`; Mixtral's `block_sparse_moe` is this module's `mlp`. An fp8 checkpoint's
per-expert `weight_scale` / `weight_scale_inv` load into FusedMoE's fp8 scales the same way.

Under tensor parallelism the router is replicated, each rank holds its slice of every expert's
intermediate dimension (FusedMoE) and the block's output is all-reduced once, as the dense MLP's
(by the next add+RMSNorm, when the decoder layer asks for partial sums: roseray.models.llama).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from roseray.config import ModelConfig, MoEConfig
from roseray.distributed import all_reduce, tensor_parallel
from roseray.layers.linear import WeightEntry
from roseray.layers.moe import ExpertActivation, FusedMoE
from roseray.models import llama
from roseray.models.hf_fields import first

# checkpoint expert projection -> (FusedMoE parameter, part): Qwen3-MoE's names, then Mixtral's
_EXPERT_PROJECTIONS = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", 0),
    "w1": ("w13", 0),
    "w3": ("w13", 1),
    "w2": ("w2", 0),
}
_PROJECTION_NAMES = "|".join(_EXPERT_PROJECTIONS)
# an expert's weight, or in an fp8 checkpoint its scale (`weight_scale`, block scales `weight_scale_inv`)
_PER_EXPERT = re.compile(rf"^(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>{_PROJECTION_NAMES})"
                         r"\.weight(?P<scale>_scale|_scale_inv)?$")
_STACKED = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


class SparseMoEBlock(nn.Module):
    """Router + experts: [num_tokens, hidden] -> the routed experts' weighted sum."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.gate.keep_unquantized = True  # the router stays in the model's dtype under fp8
        self.experts = FusedMoE(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size,
                                renormalize=moe.renormalize, activation=ExpertActivation(config.hidden_act),
                                tp=tensor_parallel())

    def forward(self, hidden: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce=False: this rank's partial sums, for the caller to all-reduce (RMSNorm.all_reduce_add)."""
        out = self.experts(hidden, self.gate(hidden))  # router logits [num_tokens, num_experts]
        return all_reduce(out) if reduce else out


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    """Whether decoder layer `layer_index` has an MoE block (else the dense gated MLP)."""
    moe = config.moe
    return moe is not None and (moe.sparse_layers is None or layer_index in moe.sparse_layers)


class SparseMoEForCausalLM(llama.LlamaForCausalLM):
    """The Llama decoder with an MoE block on the layers config.moe names (Qwen3-MoE, Mixtral)."""

    def make_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return SparseMoEBlock(config) if is_sparse_layer(config, layer_index) else llama.LlamaMLP(config)

    def _entries(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightEntry]:
        for name, tensor in weights:
            target = name.replace(".block_sparse_moe.", ".mlp.")
            if match := _PER_EXPERT.match(target):
                leaf, part = _EXPERT_PROJECTIONS[match["proj"]]
                leaf += match["scale"] or ""  # w13 | w13_scale | w13_scale_inv (FusedMoE's fp8 parameters)
                yield WeightEntry(name, f"{match['block']}.experts.{leaf}", (leaf, int(match["expert"]), part), tensor)
            elif match := _STACKED.match(target):
                yield from self._stacked_entries(name, f"{match['block']}.experts", match["proj"], tensor)
            elif target != name:  # Mixtral's router, block_sparse_moe.gate
                yield WeightEntry(name, target, None, tensor)
            else:
                yield from super()._entries([(name, tensor)])

    def _stacked_entries(self, name: str, experts: str, proj: str, tensor: torch.Tensor) -> Iterator[WeightEntry]:
        """One entry per expert (and per gate/up half) of a stacked [experts, ...] tensor."""
        num_experts = self.config.moe.num_experts if self.config.moe else 0
        if tensor.dim() != 3 or tensor.shape[0] != num_experts:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected [{num_experts}, ...] "
                             "(one slice per expert; does config.json match the checkpoint?)")
        if proj == "down_proj":
            for expert in range(num_experts):
                yield WeightEntry(name, f"{experts}.w2", ("w2", expert, 0), tensor[expert])
            return
        gate, up = tensor.chunk(2, dim=1)  # [experts, intermediate, hidden] each
        for expert in range(num_experts):
            yield WeightEntry(name, f"{experts}.w13", ("w13", expert, 0), gate[expert])
            yield WeightEntry(name, f"{experts}.w13", ("w13", expert, 1), up[expert])


def qwen3_moe_config_fields(hf: dict[str, Any], hf_architecture: str) -> dict[str, Any]:
    """ModelConfig fields from a Qwen3-MoE config.json: Qwen3's attention (q/k norm,
    attention_bias on q/k/v/o, a sliding window only with use_sliding_window) and MoE blocks on
    every `decoder_sparse_step`-th layer outside `mlp_only_layers`."""
    if hf.get("shared_expert_intermediate_size"):
        raise ValueError(f"{hf_architecture} with shared experts (shared_expert_intermediate_size) is unsupported")
    fields = _attention_fields(hf, hf_architecture, "Qwen3ForCausalLM")
    num_layers = hf["num_hidden_layers"]
    num_experts = first(hf, "num_experts", "num_local_experts", default=128)  # absent keys: transformers' defaults
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0) if num_experts else ()
    fields["moe"] = _moe_config(hf_architecture, num_experts, hf.get("num_experts_per_tok", 8),
                                hf.get("moe_intermediate_size", 768),
                                renormalize=bool(hf.get("norm_topk_prob", False)), sparse=sparse,
                                num_layers=num_layers)  # fmt: skip
    return fields


def mixtral_config_fields(hf: dict[str, Any], hf_architecture: str) -> dict[str, Any]:
    """ModelConfig fields from a Mixtral config.json: Mistral's attention (every layer slides
    when sliding_window is set) and an MoE block of `intermediate_size` experts on every layer,
    renormalised top-k. Router jitter noise is a training-time perturbation: ignored."""
    fields = _attention_fields(hf, hf_architecture, "MistralForCausalLM")
    num_layers = hf["num_hidden_layers"]
    fields["moe"] = _moe_config(hf_architecture, hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2),
                                hf["intermediate_size"], renormalize=True, sparse=tuple(range(num_layers)),
                                num_layers=num_layers)  # fmt: skip
    return fields


def _attention_fields(hf: dict[str, Any], hf_architecture: str, dense_architecture: str) -> dict[str, Any]:
    """The fields of the dense architecture whose attention (and dense MLP) this one shares."""
    if hf.get("mlp_bias"):
        raise ValueError(f"{hf_architecture} with mlp_bias=true is unsupported")
    return llama.config_fields(hf, dense_architecture)


def _moe_config(hf_architecture: str, num_experts: int, top_k: int, intermediate_size: int, *, renormalize: bool,
                sparse: tuple[int, ...], num_layers: int) -> MoEConfig | None:
    """The MoEConfig (sparse_layers None when every layer is sparse), or None with no MoE layer."""
    if not sparse:
        return None
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{hf_architecture} routes each token to {top_k} of {num_experts} experts; "
                         "num_experts_per_tok must be between 1 and the number of experts")
    return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=intermediate_size,
                     renormalize=renormalize, sparse_layers=None if len(sparse) == num_layers else sparse)
