"""FP8 weights: reading fp8 checkpoints, and quantizing a model's linear layers at load.

Formats (config.json `quantization_config`):
- `quant_method: fp8` (as transformers and the Qwen3-FP8 / DeepSeek checkpoints write it):
  e4m3 `weight`; with `weight_block_size: [r, c]` a `weight_scale_inv` [N/r, K/c] (the factor
  that dequantizes each block, fp32: `scale_fmt` ue8m0 is refused), otherwise one scale per
  tensor (`weight_scale`, or `weight_scale_inv` as transformers names it).
  `modules_to_not_convert` names layers kept in the model's dtype.
- `quant_method: compressed-tensors` (LLM Compressor), format `float-quantized` (or
  `naive-quantized`): one config group of 8-bit float weights targeting Linear, strategy
  `tensor`, `channel` ([N, 1] scales) or `block` (`block_structure`), all named `weight_scale`;
  `ignore` lists layers (names, or `re:` patterns) kept in the model's dtype.
Either may carry a static activation scale (`input_scale`, transformers' `activation_scale`): it
is not used, activations are quantized per token at run time (more precise, one launch either
way). `k_scale` / `v_scale` of attention layers (a `kv_cache_scheme`, or vLLM's
`k_proj.output_scale`) are collected for the fp8 KV cache. Anything else (int8/int4
compressed-tensors, other methods) fails with one line.

Which layers become fp8: every nn.Linear of the model except `lm_head` and modules marked
`keep_unquantized` (MoE routers), and the experts of every mixture-of-experts layer (FusedMoE:
e4m3 with a scale per expert and row). An fp8 checkpoint of an MoE model (Qwen3-MoE, Mixtral)
stores each expert's gate/up/down projection as its own e4m3 tensor with a scale in any of the
formats above: they load into FusedMoE's stacked experts, block scales requantized per row as
for Fp8Linear. Routers and whatever the checkpoint leaves unquantized stay in the model's dtype.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from roseray.layers import fused
from roseray.layers.fp8_linear import Fp8Linear
from roseray.layers.moe import FusedMoE
from roseray.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

logger = logging.getLogger(__name__)

# a fused module's checkpoint parts, for ignore lists that name the parts
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Scheme:
    """How an fp8 checkpoint stores its weights."""

    method: str  # fp8 | compressed-tensors
    scale_format: str  # tensor | channel | block
    block_size: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()


def checkpoint_fp8_scheme(hf: dict[str, Any]) -> Fp8Scheme | None:
    """The fp8 format of a config.json's quantization_config (None: not an fp8 checkpoint)."""
    qc = hf.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoint format {qc['fmt']!r} is unsupported; roseray loads e4m3")
        if (qc.get("scale_fmt") or "float") != "float":
            raise ValueError(f"fp8 checkpoint scale format {qc['scale_fmt']!r} is unsupported; roseray loads "
                             "float scales")
        ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
        block = qc.get("weight_block_size")
        if block:
            return Fp8Scheme("fp8", "block", (int(block[0]), int(block[1])), ignore)
        return Fp8Scheme("fp8", "tensor", None, ignore)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    return None


def _compressed_tensors_scheme(qc: dict[str, Any]) -> Fp8Scheme | None:
    groups = [g for g in (qc.get("config_groups") or {}).values() if g.get("weights")]
    if not groups:
        return None
    fmt = qc.get("format")
    weights = groups[0]["weights"]
    kind = f"{weights.get('num_bits')}-bit {weights.get('type')} weights"
    if len(groups) > 1 or fmt not in CT_FORMATS or weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ValueError(f"unsupported compressed-tensors checkpoint ({kind}, format {fmt!r}, {len(groups)} "
                         "config group(s)); roseray loads one group of 8-bit float (fp8) weights")
    if not set(groups[0].get("targets") or ["Linear"]) <= {"Linear"}:
        raise ValueError(f"unsupported compressed-tensors targets {groups[0]['targets']}; roseray loads Linear")
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"unsupported compressed-tensors weight strategy {strategy!r}; "
                         "roseray loads tensor, channel and block")
    block = tuple(int(v) for v in weights.get("block_structure") or (128, 128)) if strategy == "block" else None
    return Fp8Scheme("compressed-tensors", strategy, block, tuple(qc.get("ignore") or ()))


def check_fp8_device(device: torch.device) -> None:
    if not fused.HAVE_TRITON:
        raise ValueError("fp8 weights need roseray's kernel package, i.e. Triton (Linux); load the bf16 checkpoint")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"fp8 weights need an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper); {name} is "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}: load the bf16 checkpoint")


def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in list(model.named_modules()):
        keep = getattr(module, "keep_unquantized", False)
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] != "lm_head" and not keep:
            yield name, module


def _ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether an ignore list covers module `name` (all of a fused module's parts, or none)."""
    leaf = name.rpartition(".")[2]
    names = [name.replace(leaf, part) for part in _PARTS.get(leaf, ())] or [name]
    hits = [any(_matches(n, p) for p in patterns) for n in names]
    if any(hits) and not all(hits):
        raise ValueError(f"the fp8 checkpoint quantizes only some parts of {name}; roseray needs all or none")
    return all(hits)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


def _experts_ignored(name: str, experts: FusedMoE, patterns: tuple[str, ...]) -> bool:
    """Whether an ignore list covers every expert projection of FusedMoE `name` (or none of them),
    by their checkpoint names: Qwen3-MoE's `mlp.experts.{e}.gate_proj`, Mixtral's
    `block_sparse_moe.experts.{e}.w1` (w1 = gate, w3 = up, w2 = down)."""
    if not patterns:
        return False
    mixtral = name.replace(".mlp.experts", ".block_sparse_moe.experts")
    hits = [any(_matches(f"{name}.{e}.{qwen}", p) or _matches(f"{mixtral}.{e}.{mix}", p) for p in patterns)
            for e in range(experts.num_experts)
            for qwen, mix in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))]
    if any(hits) and not all(hits):
        raise ValueError(f"the fp8 checkpoint quantizes only some experts of {name}; roseray needs all or none")
    return all(hits)


def install_fp8_shells(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Before loading an fp8 checkpoint: its quantized linear layers become empty Fp8Linears and its
    quantized MoE experts empty e4m3 ones (FusedMoE.make_fp8_shell)."""
    count = 0
    for name, module in quantizable_linears(model):
        if not _ignored(name, scheme.ignore):
            model.set_submodule(name, Fp8Linear.shell_like(module, scheme.scale_format, scheme.block_size))
            count += 1
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and not _experts_ignored(name, module, scheme.ignore):
            if module.b13 is not None:
                raise ValueError("fp8 checkpoints of experts with biases are unsupported; load the bf16 "
                                 "checkpoint with quantization: fp8")
            module.make_fp8_shell(scheme.block_size if scheme.scale_format == "block" else None)
            count += 1
    return count


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme,
                       kv_scales: dict[int, dict[str, float]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors the model loads: static activation scales dropped, attention K/V scales
    collected into `kv_scales` ({layer: {"k": s, "v": s}}), block scales named weight_scale_inv
    and the others weight_scale."""
    dropped = 0
    for name, tensor in weights:
        match = _KV_SCALE.search(name)
        if match is not None:
            kind = match.group(2) or match.group(3)
            kv_scales.setdefault(int(match.group(1)), {})[kind] = float(tensor.float().max())
        elif name.endswith((".input_scale", ".activation_scale")):
            dropped += 1
        elif scheme.scale_format == "block" and name.endswith(".weight_scale"):
            yield name[: -len("weight_scale")] + "weight_scale_inv", tensor
        elif scheme.scale_format != "block" and name.endswith(".weight_scale_inv"):
            yield name[: -len("weight_scale_inv")] + "weight_scale", tensor
        else:
            yield name, tensor
    if dropped:
        logger.info("fp8 checkpoint: %d static activation scales not used (activations are quantized per token)",
                    dropped)


def finalize_fp8(model: nn.Module) -> None:
    """After loading an fp8 checkpoint: block scales -> per-row ones (Fp8Linear, FusedMoE)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.finalize()
        elif isinstance(module, FusedMoE):
            module.finalize_fp8()


@torch.no_grad()
def quantize_linears(model: nn.Module) -> int:
    """Dynamic quantization at load: every quantizable linear layer -> Fp8Linear (per channel), and
    every MoE layer's experts to e4m3 (a scale per expert and row). Returns the layers quantized."""
    count = 0
    for name, module in quantizable_linears(model):
        model.set_submodule(name, Fp8Linear.from_linear(module))
        count += 1
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.quantize_fp8()
            count += 1
    return count


def link_fp8_norms(model: nn.Module) -> int:
    """Each Llama-family norm whose output only an Fp8Linear reads (the q|k|v projection after
    input_layernorm, gate|up after post_attention_layernorm) quantizes that output per token in its
    own launch, where the layer would have quantized it (RMSNorm.fp8_consumer). Returns the norms linked."""
    linked = 0
    for layer in model.modules():
        if not isinstance(layer, LlamaDecoderLayer):
            continue
        pairs = []
        if type(layer.self_attn) is LlamaAttention:
            pairs.append((layer.input_layernorm, layer.self_attn.qkv_proj))
        if type(layer.mlp) is LlamaMLP:
            pairs.append((layer.post_attention_layernorm, layer.mlp.gate_up_proj))
        for norm, linear in pairs:
            if isinstance(linear, Fp8Linear):
                norm.fp8_consumer = tuple(linear.weight.shape)
                linked += 1
    return linked
