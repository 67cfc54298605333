"""gpt-oss (`GptOssForCausalLM`): llama.py's pre-norm decoder whose attention has q/k/v/o biases, grouped
query heads, a learned sink logit per head, and sliding-window (128) layers alternating with
full ones; YaRN RoPE; and a sparse MoE MLP in every layer (a router with a bias picks the top-k
experts, softmax over their logits; each expert is a clamped SwiGLU with biases).

Checkpoints: the experts' weights are stacked per layer. transformers saves them in bf16 as
`mlp.experts.gate_up_proj [E, hidden, 2 * inter]` (gate and up columns interleaved: gate j at
column 2j, up j at 2j + 1), `gate_up_proj_bias [E, 2 * inter]` (interleaved the same way),
`down_proj [E, inter, hidden]`, `down_proj_bias [E, hidden]` (x @ W + b). OpenAI's released
checkpoints store the two matrices in MXFP4 instead, as `gate_up_proj_blocks` / `_scales`
(rows = the 2 * inter outputs, interleaved, columns = hidden) and `down_proj_blocks` / `_scales`
(rows = hidden, columns = inter), everything else in bf16. Both load into FusedMoE's
[E, 2 * inter, hidden] (gate rows, then up rows) and [E, hidden, inter]; MXFP4 is dequantized
at load, one expert at a time on the load device, into the model's dtype.

Under tensor parallelism each rank keeps the sinks of its own query heads, its slice of every
expert (after MXFP4 dequantization: roseray.layers.moe.FusedMoE) and the whole router (with its
bias); the MoE block's output is all-reduced once, by the add+RMSNorm after it (llama.py's decoder
layer asks for partial sums).
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
from roseray.layers.tensor_parallel import split_part
from roseray.models.hf_fields import decoder_geometry, first, layer_types, rope
from roseray.models.llama import LlamaForCausalLM
from roseray.models.mxfp4 import dequantize_mxfp4

SUPPORTED_QUANTIZATION = ("mxfp4",)  # the released checkpoints' experts; see roseray.models.mxfp4

_EXPERTS = re.compile(
    r"^(?P<layer>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<kind>|_bias|_blocks|_scales)$"
)


class GptOssMoE(nn.Module):
    """The router (a linear layer with a bias) and the experts; each token's top-k experts are
    weighted by the softmax over their router logits (FusedMoE's renormalised route)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        self.router = nn.Linear(config.hidden_size, moe.num_experts, bias=True)
        self.router.keep_unquantized = True  # the router stays in the model's dtype under fp8
        activation = ExpertActivation("swiglu_clamped", alpha=float(config.hf_config.get("swiglu_alpha", 1.702)),
                                      limit=float(config.hf_config.get("swiglu_limit", 7.0)))  # fmt: skip
        self.experts = FusedMoE(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size,
                                renormalize=moe.renormalize, activation=activation, bias=True,
                                tp=tensor_parallel())  # fmt: skip

    def forward(self, hidden: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce=False: this rank's partial sums, for the caller to all-reduce (RMSNorm.all_reduce_add)."""
        out = self.experts(hidden, self.router(hidden))
        return all_reduce(out) if reduce else out


class GptOssForCausalLM(LlamaForCausalLM):
    """llama.py's decoder with attention sinks (ModelConfig.attention_sinks) and GptOssMoE in
    every layer; the checkpoint's stacked or MXFP4 experts load per expert."""

    def make_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return GptOssMoE(config)

    def _entries(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightEntry]:
        pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # MXFP4 halves waiting for their pair
        for name, tensor in weights:
            experts = _EXPERTS.match(name)
            if experts is None:
                if name.endswith(".self_attn.sinks"):
                    yield WeightEntry(name, name.replace(".sinks", ".attn.sinks"), None, self._rank_heads(tensor))
                else:
                    yield from super()._entries([(name, tensor)])
                continue
            gate_up, kind = experts["proj"] == "gate_up_proj", experts["kind"]
            target = f"{experts['layer']}.{'w13' if gate_up else 'w2'}"
            if kind == "_bias":
                yield from _stacked_bias_entries(name, f"{experts['layer']}.{'b13' if gate_up else 'b2'}", tensor)
            elif kind == "":
                yield from _stacked_matrix_entries(name, target, tensor)
            else:  # MXFP4: dequantize once both halves are in
                halves = pending.setdefault(target, {})
                halves[kind] = (name, tensor)
                if len(halves) == 2:
                    del pending[target]
                    yield from self._mxfp4_entries(target, halves["_blocks"], halves["_scales"][1])
        if pending:
            names = sorted(name for halves in pending.values() for name, _ in halves.values())
            raise ValueError(f"MXFP4 weight(s) without their blocks/scales pair in the checkpoint: {', '.join(names)}")

    def _rank_heads(self, sinks: torch.Tensor) -> torch.Tensor:
        """The sink logits of this rank's query heads (all of them outside tensor parallelism)."""
        heads = split_part(self.config.num_attention_heads, tensor_parallel(), "attention heads")
        return sinks.narrow(0, heads.start, heads.local) if sinks.shape[0] == heads.full else sinks

    def _mxfp4_entries(self, target: str, blocks: tuple[str, torch.Tensor],
                       scales: torch.Tensor) -> Iterator[WeightEntry]:
        """Per expert: dequantize [rows, cols] into the model's dtype (one expert's matrix at a time
        in memory), then the gate and up rows (interleaved) of w13, or the whole of w2."""
        name, packed = blocks
        dtype = self.lm_head.weight.dtype
        for expert in range(packed.shape[0]):
            matrix = dequantize_mxfp4(packed[expert], scales[expert], dtype)  # [rows, cols]
            if target.endswith(".w13"):
                yield WeightEntry(name, target, ("w13", expert, 0), matrix[0::2])
                yield WeightEntry(name, target, ("w13", expert, 1), matrix[1::2])
            else:
                yield WeightEntry(name, target, ("w2", expert, 0), matrix)


def _stacked_matrix_entries(name: str, target: str, stacked: torch.Tensor) -> Iterator[WeightEntry]:
    """transformers' [E, in, out] (x @ W) -> per-expert [out, in] views; gate|up interleaved."""
    for expert in range(stacked.shape[0]):
        if target.endswith(".w13"):
            yield WeightEntry(name, target, ("w13", expert, 0), stacked[expert, :, 0::2].t())
            yield WeightEntry(name, target, ("w13", expert, 1), stacked[expert, :, 1::2].t())
        else:
            yield WeightEntry(name, target, ("w2", expert, 0), stacked[expert].t())


def _stacked_bias_entries(name: str, target: str, stacked: torch.Tensor) -> Iterator[WeightEntry]:
    for expert in range(stacked.shape[0]):
        if target.endswith(".b13"):
            yield WeightEntry(name, target, ("b13", expert, 0), stacked[expert, 0::2])
            yield WeightEntry(name, target, ("b13", expert, 1), stacked[expert, 1::2])
        else:
            yield WeightEntry(name, target, ("b2", expert, 0), stacked[expert])


def config_fields(hf: dict[str, Any], hf_architecture: str) -> dict[str, Any]:
    """ModelConfig fields from a gpt-oss config.json."""
    num_layers = hf["num_hidden_layers"]
    num_experts = hf["num_local_experts"]
    top_k = first(hf, "num_experts_per_tok", "experts_per_token", default=4)
    if not 0 < top_k <= num_experts:
        raise ValueError(
            f"{hf_architecture}: num_experts_per_tok={top_k} must be in 1..num_local_experts ({num_experts})"
        )
    rope_theta, rope_scaling = rope(hf)
    window = hf.get("sliding_window")
    kinds = hf.get("layer_types")
    if not kinds and window:  # transformers' default: sliding on even layers, full on odd ones
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    attention_bias = bool(hf.get("attention_bias", True))
    return dict(
        **decoder_geometry(hf),
        hidden_act="silu",  # unused: the experts' activation is the clamped SwiGLU (swiglu_alpha, swiglu_limit)
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_proj_bias=attention_bias,
        attention_sinks=True,
        sliding_window=window if kinds and "sliding_attention" in kinds else None,
        layer_types=layer_types({"layer_types": kinds}, num_layers, window),
        moe=MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=hf["intermediate_size"],
                      renormalize=True),
    )
