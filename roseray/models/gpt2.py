"""GPT-2: learned absolute positions, pre-LayerNorm blocks, gelu_new MLP, tied lm_head.

Parameter names mirror Hugging Face's. GPT-2 checkpoints store their projections as
`Conv1D` weights of shape [in, out]; they are transposed into nn.Linear's [out, in] on load.

The residual stream travels beside the hidden states as in the Llama path: each LayerNorm
adds the previous sub-block's output to it and normalises the sum in one step (one Triton
kernel on CUDA); the first block's ln_1 adds the token and position embeddings. The sums
are the ones Hugging Face takes, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from roseray.config import ModelConfig
from roseray.layers.activation import get_activation
from roseray.layers.attention import Attention
from roseray.layers.linear import WeightEntry, load_weight_entries
from roseray.layers.norms import LayerNorm
from roseray.layers.vocab import vocab_logits, vocab_parameter
from roseray.models.hf_fields import first

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_SKIPPED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old checkpoints


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)  # q | k | v
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size)
        num_heads, head_dim = config.num_attention_heads, config.head_dim
        self.attn = Attention(num_heads, num_heads, head_dim, scale=head_dim**-0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Views of the fused projection, each [num_tokens, hidden_size] with row stride 3 * hidden_size:
        # the KV append and the attention take token-strided rows, so nothing is copied.
        q, k, v = self.c_attn(hidden).split(self.hidden_size, dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = get_activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(hidden)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous block's MLP output (the token embeddings for the first block);
        residual: the stream before it (the position embeddings) -> (this block's MLP output,
        the residual stream before it)."""
        normed, residual = self.ln_1(hidden, residual)
        hidden = self.attn(normed)
        normed, residual = self.ln_2(hidden, residual)
        return self.mlp(normed), residual


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size,
                                _weight=vocab_parameter(config.vocab_size, config.hidden_size))
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Summed by the first LayerNorm: wte + wpe, Hugging Face's embedding sum.
        hidden, residual = self.wte(input_ids), self.wpe(positions)  # each [num_tokens, hidden_size]
        for block in self.h:
            hidden, residual = block(hidden, residual)
        return self.ln_f(hidden, residual)[0]


class GPT2ForCausalLM(nn.Module):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        self.config = model_config
        self.transformer = GPT2Model(model_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] in the model's dtype (lm_head tied to
        wte; a view of logits over 50304 padded rows for GPT-2's 50257: see roseray.layers.vocab).
        Not upcast here: a greedy batch takes the argmax of the bf16 logits as they are (the same
        index as over an fp32 copy), and the sampler upcasts the rows that need more."""
        return vocab_logits(hidden, self.transformer.wte.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weight_entries(self, self._entries(weights))

    def _entries(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[WeightEntry]:
        for name, tensor in weights:
            if name == "lm_head.weight" or name.endswith(_SKIPPED):
                continue
            # The original gpt2 checkpoint names its tensors without the "transformer." prefix.
            param_name = name if name.startswith("transformer.") else f"transformer.{name}"
            if name.endswith(_CONV1D):
                tensor = tensor.t()
            yield WeightEntry(name, param_name, None, tensor)


def config_fields(hf: dict[str, Any], hf_architecture: str) -> dict[str, Any]:
    """ModelConfig fields from a GPT-2 config.json."""
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise ValueError(
            "GPT-2 variants with scale_attn_by_inverse_layer_idx or without scale_attn_weights are unsupported"
        )
    if not hf.get("tie_word_embeddings", True):
        raise ValueError("GPT-2 without tied word embeddings is unsupported")
    hidden = first(hf, "n_embd", "hidden_size")
    heads = first(hf, "n_head", "num_attention_heads")
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=first(hf, "n_layer", "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=first(hf, "n_inner", default=4 * hidden),
        max_position_embeddings=first(hf, "n_positions", "n_ctx", "max_position_embeddings"),
        hidden_act=hf.get("activation_function", "gelu_new"),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=True,
    )
