"""Hugging Face architecture names -> roseray model classes."""

from __future__ import annotations

from torch import nn

from roseray.config import ModelConfig
from roseray.models.gpt2 import GPT2ForCausalLM
from roseray.models.llama import LlamaForCausalLM

# architecture in config.json -> (ModelConfig.architecture, class)
_ARCHITECTURES: dict[str, tuple[str, type[nn.Module]]] = {
    "GPT2LMHeadModel": ("gpt2", GPT2ForCausalLM),
    "LlamaForCausalLM": ("llama", LlamaForCausalLM),
    "MistralForCausalLM": ("llama", LlamaForCausalLM),
    "Qwen2ForCausalLM": ("llama", LlamaForCausalLM),
    "Qwen3ForCausalLM": ("llama", LlamaForCausalLM),
}
_FAMILIES: dict[str, type[nn.Module]] = {"gpt2": GPT2ForCausalLM, "llama": LlamaForCausalLM}

SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))


def architecture_family(hf_architecture: str) -> str:
    """'LlamaForCausalLM' -> 'llama'; ValueError listing the supported names otherwise."""
    if hf_architecture not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {hf_architecture!r}; "
            f"roseray supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _ARCHITECTURES[hf_architecture][0]


def get_model_class(model_config: ModelConfig) -> type[nn.Module]:
    """The class for a ModelConfig: by its config.json architecture name, else by its family."""
    if model_config.hf_architecture:
        architecture_family(model_config.hf_architecture)  # raises for an unsupported name
        return _ARCHITECTURES[model_config.hf_architecture][1]
    if model_config.architecture not in _FAMILIES:
        raise ValueError(f"unknown model family {model_config.architecture!r}; expected one of {sorted(_FAMILIES)}")
    return _FAMILIES[model_config.architecture]
