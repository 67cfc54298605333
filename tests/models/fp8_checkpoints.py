"""Writing a tiny checkpoint's linear layers (and MoE experts: one tensor per expert and
projection, as Qwen3-MoE's and Mixtral's fp8 releases store them) in each fp8 format roseray
reads, and the dequantized weights such a checkpoint stands for (the tests' reference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from roseray_kernels.fp8_quant import FP8_DTYPE, FP8_MAX, quantize_per_channel

FORMATS = ("fp8-tensor", "fp8-block", "ct-tensor", "ct-channel", "ct-block")
BLOCK = (16, 16)
# the HF names of the layers roseray quantizes (lm_head and MoE routers, `mlp.gate`, stay as they are):
# attention, dense MLPs and Qwen3-MoE experts (`mlp.experts.{e}.gate_proj`), then Mixtral's experts
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale tensor as the format stores it, dequantized fp32 weight)."""
    w = w.float()
    if strategy == "channel":
        q, scale = quantize_per_channel(w)
        return q, scale[:, None], q.float() * scale[:, None]
    if strategy == "tensor":
        scale = w.abs().max() / FP8_MAX
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale, q.float() * scale
    r, c = BLOCK
    n, k = w.shape
    blocks = w.reshape(n // r, r, k // c, c)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [n/r, k/c]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(n, k), scale, (q.float() * scale[:, None, :, None]).reshape(n, k)


def bf16_rounded_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor rounded to bf16 (stored in its own dtype): what a bf16 engine loads
    is then exactly what the fp8 writer quantizes."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {name: t.to(torch.bfloat16).to(t.dtype) for name, t in load_file(src / "model.safetensors").items()}
    save_file(tensors, dst / "model.safetensors")
    return dst


def write_fp8_checkpoint(src: Path, dst: Path, fmt: str, kv_scales: float | None = None,
                         static_activations: bool = False, keep: str | None = None) -> dict[str, torch.Tensor]:
    """Copy checkpoint `src` to `dst` with its linear layers in fp8 format `fmt` (FORMATS), except
    the layers whose names contain `keep` (left as they are, named in the format's ignore list);
    returns {name: dequantized fp32 weight} of every quantized layer."""
    method, strategy = fmt.split("-")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors, dequantized, kept = {}, {}, []
    for name, tensor in load_file(src / "model.safetensors").items():
        layer = name.rpartition(".")[0]
        if not (name.endswith(".weight") and layer.rpartition(".")[2] in QUANTIZED):
            tensors[name] = tensor
            continue
        if keep is not None and keep in layer:
            tensors[name] = tensor
            kept.append(layer)
            continue
        q, scale, dequantized[name] = _quantize(tensor, strategy)
        tensors[name] = q
        scale_name = "weight_scale_inv" if method == "fp8" and strategy == "block" else "weight_scale"
        tensors[f"{layer}.{scale_name}"] = scale.reshape(1) if method == "ct" and strategy == "tensor" else scale
        if static_activations:
            tensors[f"{layer}.input_scale"] = torch.tensor(0.05)
    config = json.loads((src / "config.json").read_text())
    layers = config["num_hidden_layers"]
    if kv_scales is not None:
        for i in range(layers):
            for kv in "kv":
                tensors[f"model.layers.{i}.self_attn.{kv}_scale"] = torch.tensor(kv_scales * (1 + i))
    if method == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "modules_to_not_convert": ["lm_head", *kept],
              "activation_scheme": "static" if static_activations else "dynamic"}
        if strategy == "block":
            qc["weight_block_size"] = list(BLOCK)
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
        if strategy == "block":
            weights["block_structure"] = list(BLOCK)
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", *kept],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                            "input_activations": {"num_bits": 8, "type": "float",
                                                                  "strategy": "token", "dynamic": True}}}}
        if kv_scales is not None:
            qc["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    return dequantized
