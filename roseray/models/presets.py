"""`random:<name>` presets: real model geometries with random weights, for tests and
benchmarks without a checkpoint. Their tokenizer is roseray's byte tokenizer, whose EOS id
is vocab_size - 1."""

from __future__ import annotations

from roseray.config import ModelConfig

PREFIX = "random:"


def _tiny() -> ModelConfig:
    return ModelConfig(
        architecture="llama", hf_architecture="LlamaForCausalLM",
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_ids=[511],
    )  # fmt: skip


def _gpt2() -> ModelConfig:
    return ModelConfig(
        architecture="gpt2", hf_architecture="GPT2LMHeadModel",
        vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
        head_dim=64, intermediate_size=3072, max_position_embeddings=1024,
        hidden_act="gelu_new", layer_norm_eps=1e-5, tie_word_embeddings=True, eos_token_ids=[50256],
    )  # fmt: skip


def _qwen3_0_6b() -> ModelConfig:
    return ModelConfig(
        architecture="llama", hf_architecture="Qwen3ForCausalLM",
        vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True,
        eos_token_ids=[151935],
    )  # fmt: skip


def _llama_3_2_1b() -> ModelConfig:
    return ModelConfig(
        architecture="llama", hf_architecture="LlamaForCausalLM",
        vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        eos_token_ids=[128255],
    )  # fmt: skip


PRESETS = {
    "tiny": _tiny,
    "gpt2": _gpt2,
    "qwen3-0.6b": _qwen3_0_6b,
    "llama-3.2-1b": _llama_3_2_1b,
}


def is_preset(model: str) -> bool:
    return model.startswith(PREFIX)


def preset_config(model: str) -> ModelConfig:
    """'random:tiny' -> a fresh ModelConfig; ValueError listing the presets otherwise."""
    name = model[len(PREFIX):] if is_preset(model) else model
    if name not in PRESETS:
        known = ", ".join(PREFIX + n for n in PRESETS)
        raise ValueError(f"unknown random preset {model!r}; available: {known}")
    return PRESETS[name]()
