"""Gemma 2 and Gemma 3 (text): a decoder with four norms per layer (before and after attention,
before and after the MLP), embeddings scaled by sqrt(hidden_size), a gelu-tanh gated MLP,
attention scaled by query_pre_attn_scalar**-0.5, local (sliding-window) and global layers as
config.json's layer_types says, and tied embeddings.
Gemma 2: attention logit softcapping on every layer and final logit softcapping.
Gemma 3: per-head q/k RMSNorm, and local layers with their own RoPE base
(rope_local_base_freq) while the global layers carry the rope scaling (linear in 4B-27B).

Gemma's RMSNorm multiplies by (1 + weight). The checkpoint's weights are stored as 1 + w at
load time, so roseray's RMSNorm and its fused add+norm and q/k norm+RoPE Triton kernels apply
unchanged (a random init's norm weight 1 is w = 0, transformers' init). In bf16 the one
difference from transformers is where the product is rounded: transformers multiplies the
fp32 normalised row by (1 + w) and rounds once; roseray rounds the row, then the product.

The residual stream travels beside the hidden states as in the Llama decoder: the input and
pre-feedforward norms add the residual and normalise in one step; the post-attention and
post-feedforward norms normalise a sub-block's output before it joins the stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from roseray.config import ModelConfig
from roseray.layers.linear import WeightEntry
from roseray.layers.norms import RMSNorm
from roseray.layers.rotary import RotaryEmbedding
from roseray.models.hf_fields import decoder_geometry, layer_types, rope
from roseray.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, make_embedding

GEMMA3 = "Gemma3ForCausalLM"
# transformers' defaults for what older config.json files leave out
_DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
_GEMMA3_GLOBAL_THETA, _GEMMA3_LOCAL_THETA = 1_000_000.0, 10_000.0
_SLIDING_PATTERN = {"Gemma2ForCausalLM": 2, GEMMA3: 6}  # every n-th layer global, the others local

class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, layer_index: int, scale: float) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, rotary_emb, layer_index, scale)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's normalised MLP output, not yet in the residual stream
        (the scaled embeddings for the first layer, with no residual yet) -> (this layer's, the
        residual stream before it)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config)
        # sqrt(hidden_size) rounded to the model's dtype, as transformers multiplies it
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        local_rotary_emb = self.rotary_emb
        if config.hf_architecture == GEMMA3:
            local_theta, local_scaling = gemma3_rope(config.hf_config)[1]
            local_rotary_emb = self.local_rotary_emb = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, local_theta, local_scaling
            )
        scale = config.hf_config.get("query_pre_attn_scalar", _DEFAULT_QUERY_PRE_ATTN_SCALAR) ** -0.5
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, local_rotary_emb if config.is_sliding(i) else self.rotary_emb, i, scale)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (Gemma2ForCausalLM) and Gemma 3 text (Gemma3ForCausalLM): llama.py's attention,
    MLP, embedding, lm_head and checkpoint names around Gemma's own decoder stack (so it shards
    under tensor parallelism as the Llama family does)."""

    def make_model(self, config: ModelConfig) -> nn.Module:
        return GemmaModel(config)

    def _entries(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightEntry]:
        for entry in super()._entries(weights):
            owner_name, _, leaf = entry.param_name.rpartition(".")
            if leaf == "weight" and isinstance(self._module(owner_name), RMSNorm):
                entry = entry._replace(tensor=entry.tensor.float() + 1.0)  # Gemma's norms scale by (1 + w)
            yield entry

    def _module(self, name: str) -> nn.Module | None:
        try:
            return self.get_submodule(name)
        except AttributeError:
            return None  # an unknown name: load_weight_entries reports it


def gemma3_rope(hf: dict[str, Any]) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((rope_theta, rope_scaling) of the global layers, the same of the local ones) from either
    transformers 5's per-layer-kind `rope_parameters` or the older rope_theta + rope_scaling
    (global) and rope_local_base_freq (local)."""
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, local = {**(hf.get("rope_scaling") or {}), **params}, {}
    full.setdefault("rope_theta", hf.get("rope_theta", _GEMMA3_GLOBAL_THETA))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA))
    return rope({"rope_parameters": full}), rope({"rope_parameters": local})


def _layer_types(hf: dict[str, Any], hf_architecture: str, window: int | None) -> tuple[str, ...]:
    """config.json's layer_types, else transformers' default pattern (Gemma 2 alternates local and
    global layers; Gemma 3 has sliding_window_pattern - 1 local layers before each global one)."""
    num_layers = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if not kinds:
        pattern = hf.get("sliding_window_pattern") or _SLIDING_PATTERN[hf_architecture]
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return layer_types({"layer_types": kinds}, num_layers, window)


def config_fields(hf: dict[str, Any], hf_architecture: str) -> dict[str, Any]:
    """ModelConfig fields from a Gemma 2 or Gemma 3 text config.json."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{hf_architecture} with use_bidirectional_attention=true is unsupported")
    gemma3 = hf_architecture == GEMMA3
    window = hf.get("sliding_window")
    kinds = _layer_types(hf, hf_architecture, window)
    rope_theta, rope_scaling = gemma3_rope(hf)[0] if gemma3 else rope(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    return dict(
        **decoder_geometry(hf),
        hidden_act=hf.get("hidden_activation") or "gelu_pytorch_tanh",
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=attention_bias,
        o_proj_bias=attention_bias,
        qk_norm=gemma3,
        sliding_window=window if "sliding_attention" in kinds else None,
        layer_types=kinds,
        # transformers' Gemma 3 attention takes no logit softcap, whatever its config says
        attn_logit_softcap=None if gemma3 else hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )
