"""Llama-family decoder: Llama 2/3, Qwen2/2.5 (qkv bias), Qwen3 (per-head q/k RMSNorm),
Mistral (sliding-window attention). Grouped-query attention through the paged `Attention` layer, fused q|k|v and
gate|up projections, RoPE by position index.

Parameter names mirror Hugging Face's, so loading only maps q/k/v and gate/up onto the
fused projections.

On CUDA a layer runs two fused add+RMSNorm kernels, one kernel for q/k norm + RoPE and one
for SiLU-and-mul around its matmuls and attention (roseray_kernels, via roseray.layers);
on CPU the same layers run their torch code.

Under tensor parallelism a block's row-parallel output (o_proj, down_proj, an MoE block's
experts) is this rank's partial sums; the decoder layer has the attention and the MLP return
them unreduced (`reduce=False`) and the add+RMSNorm that follows (the post-attention norm; after
the MLP, the next layer's input norm or the final norm) takes the all-reduce
(RMSNorm.all_reduce_add): one launch with the triton all-reduce method, the all-reduce then the
add+norm elsewhere. Other decoders that use the attention or MLP (Gemma's post-norms) keep the
default `reduce=True`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from roseray.config import ModelConfig
from roseray.distributed import all_reduce, tensor_parallel
from roseray.layers.activation import GatedActivation
from roseray.layers.attention import Attention
from roseray.layers.linear import WeightEntry, load_weight_entries
from roseray.layers.norms import RMSNorm
from roseray.layers.rotary import RotaryEmbedding
from roseray.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    kv_head_part,
    split_part,
)
from roseray.layers.vocab import vocab_logits, vocab_parameter
from roseray.models.hf_fields import decoder_geometry, layer_types, rope

# Hugging Face projection name -> (fused projection, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    """q|k|v projection, optional per-head q/k RMSNorm, RoPE, paged attention (the layer's
    window, the model's logit softcap and sinks), output projection. `scale` defaults to
    head_dim ** -0.5. Under tensor parallelism a rank holds its share of the heads (roseray.
    layers.tensor_parallel) and the output projection's partial sums are all-reduced (or, with
    `reduce=False`, returned for the caller's norm to reduce)."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, layer_index: int,
                 scale: float | None = None) -> None:
        super().__init__()
        tp = tensor_parallel()
        self.head_dim = config.head_dim
        q_part = split_part(config.num_attention_heads * self.head_dim, tp, "attention heads")
        kv_part = kv_head_part(config.num_key_value_heads, self.head_dim, tp)
        self.q_size, self.kv_size = q_part.local, kv_part.local
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_part, kv_part, kv_part], bias=config.attention_bias)
        self.o_proj = RowParallelLinear(q_part.full, config.hidden_size, tp, bias=config.o_proj_bias,
                                        what="attention heads")
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = rotary_emb  # shared by every layer (of its kind)
        window = config.sliding_window if config.is_sliding(layer_index) else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim**-0.5 if scale is None else scale, sliding_window=window,
                              softcap=config.attn_logit_softcap, has_sinks=config.attention_sinks)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        q, k = self.rotary_emb.rotate_qk(positions, q, k, self.q_norm, self.k_norm)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v)
        out = self.o_proj(out)
        return all_reduce(out) if reduce else out


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        tp = tensor_parallel()
        part = split_part(config.intermediate_size, tp, "intermediate size")
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [part, part], bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, tp, bias=False,
                                           what="intermediate size")
        self.act = GatedActivation(config.hidden_act)

    def forward(self, hidden: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """reduce=False: this rank's partial sums, for the caller to all-reduce (RMSNorm.all_reduce_add)."""
        out = self.down_proj(self.act(self.gate_up_proj(hidden)))
        return all_reduce(out) if reduce else out


# (config, layer index) -> that decoder layer's MLP: forward(hidden [num_tokens, hidden], reduce) ->
# [num_tokens, hidden], all-reduced across the tensor-parallel ranks unless reduce=False
MLPFactory = Callable[[ModelConfig, int], nn.Module]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the hidden states: each norm adds
    the previous sub-block's output to it and normalises the sum in one step, and under tensor
    parallelism takes that output's all-reduce too (the sub-blocks return partial sums)."""

    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, layer_index: int, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary_emb, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's MLP output, this rank's partial sums (the embeddings,
        whole, for the first layer, with no residual yet) -> (this layer's MLP output, partial
        sums, and the residual stream before it)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.all_reduce_add(hidden, residual)
        hidden = self.self_attn(positions, hidden, reduce=False)
        hidden, residual = self.post_attention_layernorm.all_reduce_add(hidden, residual)
        return self.mlp(hidden, reduce=False), residual


def make_embedding(config: ModelConfig) -> nn.Module:
    """The token embeddings: vocabulary-parallel under tensor parallelism, else whole (rows padded)."""
    tp = tensor_parallel()
    if tp.size > 1:
        return VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
    return nn.Embedding(config.vocab_size, config.hidden_size,
                        _weight=vocab_parameter(config.vocab_size, config.hidden_size))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_mlp: MLPFactory) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, i, make_mlp(config, i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)  # the MLP's partial sums
        return self.norm(hidden) if residual is None else self.norm.all_reduce_add(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        self.config = model_config
        self.model = self.make_model(model_config)
        tp = tensor_parallel()
        if tp.size > 1:  # this rank's vocabulary rows; logits gathered in compute_logits
            self.lm_head = VocabParallelLMHead(model_config.vocab_size, model_config.hidden_size, tp)
            if model_config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
            return
        self.lm_head = nn.Linear(model_config.hidden_size, model_config.vocab_size, bias=False, device="meta")
        if model_config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head.weight = vocab_parameter(model_config.vocab_size, model_config.hidden_size)

    def make_model(self, config: ModelConfig) -> nn.Module:
        """The decoder stack: embeddings -> layers -> final norm (a subclass may build its own)."""
        return LlamaModel(config, self.make_mlp)

    def make_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        """The MLP of decoder layer `layer_index`: the dense gated MLP (a subclass may put
        another block, e.g. a sparse mixture of experts, on some layers)."""
        return LlamaMLP(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float32 (a view of padded logits
        when the vocabulary is not a multiple of 64: see roseray.layers.vocab), softcapped
        (cap * tanh(logits / cap)) when the model says so (Gemma 2)."""
        if isinstance(self.lm_head, VocabParallelLMHead):
            logits = self.lm_head.logits(hidden).float()
        else:
            logits = vocab_logits(hidden, self.lm_head.weight).float()
        cap = self.config.final_logit_softcap
        if cap is not None:  # in place: the fp32 logits are this call's own tensor
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weight_entries(self, self._entries(weights))

    def _entries(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightEntry]:
        for name, tensor in weights:
            if name.endswith(_SKIPPED) or (self.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            match = _FUSED_NAME.search(name)
            if match is None:
                yield WeightEntry(name, name, None, tensor)
                continue
            fused, shard = _FUSED[match.group(1)]
            yield WeightEntry(name, name.replace(f".{match.group(1)}.", f".{fused}."), shard, tensor)


def config_fields(hf: dict[str, Any], hf_architecture: str) -> dict[str, Any]:
    """ModelConfig fields from a Llama / Qwen2 / Qwen3 / Mistral config.json."""
    if hf.get("mlp_bias"):
        raise ValueError(f"{hf_architecture} with mlp_bias=true is unsupported")
    rope_theta, rope_scaling = rope(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    uses_window = hf_architecture == "MistralForCausalLM" or hf.get("use_sliding_window", False)
    window = hf.get("sliding_window") if uses_window else None
    return dict(
        **decoder_geometry(hf),
        hidden_act=hf.get("hidden_act", "silu"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama/Qwen3's attention_bias covers both.
        attention_bias=hf_architecture == "Qwen2ForCausalLM" or attention_bias,
        o_proj_bias=hf_architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias,
        qk_norm=hf_architecture == "Qwen3ForCausalLM",
        sliding_window=window,
        layer_types=layer_types(hf, hf["num_hidden_layers"], window),
    )
