"""Tiny random Hugging Face checkpoints for parity tests, built offline.

`make_tiny_model(kind, path)` builds a seeded fp32 model with transformers, saves it with
safetensors (optionally sharded) and saves a small byte-level BPE tokenizer (trained on an
in-memory corpus, with a ChatML-style chat template) next to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
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
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

KINDS = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss")
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


def hf_config(kind: str):
    """A tiny config of each kind; eager attention, tie settings explicit."""
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
}


def make_hf_model(kind: str, seed: int = 0, config=None) -> PreTrainedModel:
    """A seeded fp32 random model in eval mode (of `config`, default hf_config(kind)). Norm
    weights are perturbed away from 1 so a norm applied wrongly (or not at all) shows in the
    logits; MoE routers are scaled by ROUTER_SCALE."""
    config = config or hf_config(kind)
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
                    save_original_format: bool = True) -> Path:
    """Save a tiny random `kind` model (+ tokenizer) to `path` as safetensors; pass e.g.
    max_shard_size="20KB" to get a sharded checkpoint with model.safetensors.index.json.
    MoE experts are saved one tensor per expert (the Hub's names); save_original_format=False
    writes transformers' stacked layout instead (mlp.experts.gate_up_proj / down_proj)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = make_hf_model(kind, seed, config)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, save_original_format=save_original_format, **kwargs)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def load_hf_model(path: Path) -> PreTrainedModel:
    """The saved checkpoint, read back by transformers (fp32, eager attention)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def set_architecture(path: Path, architecture: str) -> None:
    """Rewrite config.json's architectures (for unsupported-architecture tests)."""
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [architecture]
    config_file.write_text(json.dumps(config))
