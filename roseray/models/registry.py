"""Hugging Face architecture names -> roseray model classes and their config.json parsers.

Each model module defines the model class and `config_fields(hf, hf_architecture)`, which
turns its config.json into ModelConfig fields (raising ValueError naming any feature it
does not implement)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn

from roseray.config import ModelConfig
from roseray.models import gemma, gpt2, gpt_oss, llama, mixture_of_experts, phi3


class ArchitectureEntry(NamedTuple):
    family: str  # ModelConfig.architecture
    model_class: type[nn.Module]
    config_fields: Callable[[dict[str, Any], str], dict[str, Any]]
    # quantization_config.quant_method values this model loads beyond hf_fields.SUPPORTED_QUANTIZATION
    supported_quantization: tuple[str, ...] = ()


_GPT2 = ArchitectureEntry("gpt2", gpt2.GPT2ForCausalLM, gpt2.config_fields)
_LLAMA = ArchitectureEntry("llama", llama.LlamaForCausalLM, llama.config_fields)
_GPT_OSS = ArchitectureEntry("gpt_oss", gpt_oss.GptOssForCausalLM, gpt_oss.config_fields,
                             supported_quantization=gpt_oss.SUPPORTED_QUANTIZATION)
_QWEN3_MOE = ArchitectureEntry("qwen3_moe", mixture_of_experts.SparseMoEForCausalLM,
                               mixture_of_experts.qwen3_moe_config_fields)
_MIXTRAL = ArchitectureEntry("mixtral", mixture_of_experts.SparseMoEForCausalLM,
                             mixture_of_experts.mixtral_config_fields)
_GEMMA = ArchitectureEntry("gemma", gemma.GemmaForCausalLM, gemma.config_fields)
_PHI3 = ArchitectureEntry("phi3", phi3.Phi3ForCausalLM, phi3.config_fields)

_ARCHITECTURES: dict[str, ArchitectureEntry] = {
    "GPT2LMHeadModel": _GPT2,
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
    "GptOssForCausalLM": _GPT_OSS,
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "MixtralForCausalLM": _MIXTRAL,
    "Phi3ForCausalLM": _PHI3,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
}
_FAMILIES: dict[str, type[nn.Module]] = {entry.family: entry.model_class for entry in _ARCHITECTURES.values()}

SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))


def architecture_entry(hf_architecture: str) -> ArchitectureEntry:
    """The entry for a config.json architecture name; ValueError listing the supported names otherwise."""
    if hf_architecture not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {hf_architecture!r}; "
            f"roseray supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _ARCHITECTURES[hf_architecture]


def architecture_family(hf_architecture: str) -> str:
    """'LlamaForCausalLM' -> 'llama'; ValueError listing the supported names otherwise."""
    return architecture_entry(hf_architecture).family


def get_model_class(model_config: ModelConfig) -> type[nn.Module]:
    """The class for a ModelConfig: by its config.json architecture name, else by its family."""
    if model_config.hf_architecture:
        return architecture_entry(model_config.hf_architecture).model_class
    if model_config.architecture not in _FAMILIES:
        raise ValueError(f"unknown model family {model_config.architecture!r}; expected one of {sorted(_FAMILIES)}")
    return _FAMILIES[model_config.architecture]
