"""Tiny random Hugging Face checkpoints for parity tests, built offline.

`make_tiny_model(kind, path)` builds a seeded fp32 model with transformers, saves it with
safetensors (optionally sharded) and saves a small byte-level BPE tokenizer (trained on an
in-memory corpus, with a ChatML-style chat template) next to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

KINDS = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss", "gemma2", "gemma3",
         "phi3", "phi3-longrope")
VOCAB_SIZE = 320  # >= the tokenizer's 256 bytes + merges + special tokens
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello roseray: paged attention and continuous batching",
    "naïve café – déjà vu ✓ 日本語 🙂",
] * 20
_MOE_KINDS = ("qwen3_moe", "mixtral")
_COMMON = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
_LLAMA_GEOMETRY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, rms_norm_eps=1e-6)  # fmt: skip
# Gemma: 4 layers (local and global ones), head_dim 32 (!= hidden / heads), a window of 8 tokens that
# the tests' prompts cross, query_pre_attn_scalar != head_dim, weights large enough (initializer_range)
# and caps small enough that both softcaps change the logits.
_GEMMA_GEOMETRY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                       initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       hidden_activation="gelu_pytorch_tanh", pad_token_id=0)  # fmt: skip
_PHI3_GEOMETRY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0)
_LONGROPE_ORIGINAL = 32  # Phi-3 longrope: the pretraining context, below max_position_embeddings (128)


def _longrope_factors(seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    return (1.0 + 3.0 * torch.rand(8, generator=generator)).tolist()  # head_dim 16: 8 frequencies


def hf_config(kind: str, **overrides):
    """A tiny config of each kind (`overrides` on top); eager attention, tie settings explicit."""
    config = _hf_config(kind)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def _hf_config(kind: str):
    if kind == "gpt2":
        return GPT2Config(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                          tie_word_embeddings=True)  # fmt: skip
    if kind == "llama":  # GQA, llama3 rope scaling, untied lm_head
        return LlamaConfig(**_COMMON, **_LLAMA_GEOMETRY, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 32})  # fmt: skip
    if kind == "qwen2":  # q/k/v bias, tied embeddings
        return Qwen2Config(**_COMMON, **_LLAMA_GEOMETRY, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})  # fmt: skip
    if kind == "qwen3":  # q/k norm, head_dim (32) != hidden / heads (16)
        return Qwen3Config(**_COMMON, **{**_LLAMA_GEOMETRY, "num_hidden_layers": 3}, head_dim=32,
                           tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})  # fmt: skip
    if kind == "mistral":
        return MistralConfig(**_COMMON, **_LLAMA_GEOMETRY, tie_word_embeddings=False, sliding_window=None,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    if kind == "gpt_oss":  # sliding(8)/full layers, sinks, 8 experts top-2, YaRN past 32 positions
        return GptOssConfig(**_COMMON, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                            num_experts_per_tok=2, sliding_window=8, rms_norm_eps=1e-5, tie_word_embeddings=False,
                            layer_types=["sliding_attention", "full_attention"] * 2,
                            swiglu_limit=0.3,  # low enough that the clamp acts on these tiny activations
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                             "original_max_position_embeddings": 32})  # fmt: skip
    if kind == "qwen3_moe":  # top-4 of 8 renormalised, layer 1 dense (mlp_only_layers), head_dim 32
        return Qwen3MoeConfig(**_COMMON, **{**_LLAMA_GEOMETRY, "num_hidden_layers": 3}, head_dim=32,
                              tie_word_embeddings=False, num_experts=8, num_experts_per_tok=4,
                              moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                              mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                              )  # fmt: skip
    if kind == "mixtral":  # top-2 of 8, every layer slides over 8 positions
        return MixtralConfig(**_COMMON, **{**_LLAMA_GEOMETRY, "intermediate_size": 32}, tie_word_embeddings=False,
                             num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
    if kind == "gemma2":  # local/global layers alternate; attention and final logit softcaps
        return Gemma2Config(**_COMMON, **_GEMMA_GEOMETRY, attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    if kind == "gemma3":  # q/k norm, local RoPE base != global, linear scaling on the global layers
        return Gemma3TextConfig(**_COMMON, **_GEMMA_GEOMETRY, final_logit_softcapping=3.0,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                             "sliding_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                    "rope_theta": 10000.0}})  # fmt: skip
    if kind == "phi3":  # fused qkv / gate_up in the checkpoint, a sliding window on every layer
        return Phi3Config(**_COMMON, **_PHI3_GEOMETRY, sliding_window=8,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    if kind == "phi3-longrope":  # LongRoPE: the long factors apply (max_position_embeddings > original)
        return Phi3Config(**_COMMON, **_PHI3_GEOMETRY, sliding_window=None,
                          original_max_position_embeddings=_LONGROPE_ORIGINAL,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": _longrope_factors(1), "long_factor": _longrope_factors(2)})
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


# Router weights scaled from N(0, 0.02) so each token's expert probabilities are far from uniform
# and a wrong choice or weighting of experts shows in the logits.
ROUTER_SCALE = 10.0


_MODEL_CLASSES = {
    "gpt2": GPT2LMHeadModel,
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "phi3-longrope": Phi3ForCausalLM,
}


def make_hf_model(kind: str, seed: int = 0, config=None, **overrides) -> PreTrainedModel:
    """A seeded fp32 random model in eval mode (of `config`, default hf_config(kind, **overrides)).
    Norm weights are perturbed away from their init so a norm applied wrongly (or not at all)
    shows in the logits; MoE routers are scaled by ROUTER_SCALE."""
    config = config or hf_config(kind, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _MODEL_CLASSES[kind](config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):  # a sink logit near the scores' scale, so it matters
                param.copy_(torch.randn_like(param))
            elif name.endswith("_proj_bias"):  # stacked expert biases (initialised to zero)
                param.copy_(torch.randn_like(param) * 0.1)
            elif param.dim() == 1:  # norm weights and biases
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("mlp.gate.weight") and kind in _MOE_KINDS:  # routers
                param.mul_(ROUTER_SCALE)
    return model


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a tiny in-memory corpus, offline."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 8,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def make_tiny_model(kind: str, path: Path, max_shard_size: str | None = None, seed: int = 0, config=None,
                    save_original_format: bool = True, **overrides) -> Path:
    """Save a tiny random `kind` model (+ tokenizer) to `path` as safetensors; pass e.g.
    max_shard_size="20KB" to get a sharded checkpoint with model.safetensors.index.json, and
    config attributes to change as `overrides` (e.g. head_dim=256). MoE experts are saved one
    tensor per expert (the Hub's names); save_original_format=False writes transformers'
    stacked layout instead (mlp.experts.gate_up_proj / down_proj)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = make_hf_model(kind, seed, config, **overrides)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, save_original_format=save_original_format, **kwargs)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def load_hf_model(path: Path) -> PreTrainedModel:
    """The saved checkpoint, read back by transformers (fp32, eager attention), as roseray's
    reference (see `use_longrope_long_factors`, `skip_unless_reference`)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return use_longrope_long_factors(skip_unless_reference(model))


def skip_unless_reference(model: PreTrainedModel) -> PreTrainedModel:
    """Skip the calling test where this transformers cannot be the reference for the tiny
    model: releases before gpt-oss's config.swiglu_limit was read hard-code the limit at 7.0
    (the tiny gpt-oss sets 0.3 so that the clamp acts)."""
    limit = getattr(model.config, "swiglu_limit", None)
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts") and hasattr(m, "limit")]
    if limit is not None and experts and experts[0].limit != limit:
        pytest.skip(f"transformers {transformers.__version__} ignores config.swiglu_limit (uses {experts[0].limit})")
    return model


def use_longrope_long_factors(model: PreTrainedModel) -> PreTrainedModel:
    """A LongRoPE model (Phi-3) made to rotate with its long factors at every length.

    transformers picks the short or long factors per forward by the longest sequence in it (so
    a sequence that grows past the original context re-rotates only its new keys); roseray, like
    vLLM, picks them once for the model: the long ones when its context goes past the original
    (roseray.layers.rotary). The reference is set to that choice; other models pass unchanged."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if getattr(rotary, "rope_type", None) != "longrope":
        return model
    original = model.config.rope_parameters["original_max_position_embeddings"]
    assert model.config.max_position_embeddings > original, "a longrope test model serves past its original context"
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, None, seq_len=original + 1)
    with torch.no_grad():
        rotary.original_inv_freq.copy_(long_inv_freq)
        rotary.inv_freq.copy_(long_inv_freq)
    return model


def set_architecture(path: Path, architecture: str) -> None:
    """Rewrite config.json's architectures (for unsupported-architecture tests)."""
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [architecture]
    config_file.write_text(json.dumps(config))
