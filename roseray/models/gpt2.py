"""GPT-2: learned absolute positions, pre-LayerNorm blocks, gelu_new MLP, tied lm_head.

Parameter names mirror Hugging Face's. GPT-2 checkpoints store their projections as
`Conv1D` weights of shape [in, out]; they are transposed into nn.Linear's [out, in] on load.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from roseray.config import ModelConfig
from roseray.layers.activation import get_activation
from roseray.layers.attention import Attention
from roseray.layers.linear import WeightEntry, load_weight_entries
from roseray.layers.vocab import vocab_logits, vocab_parameter

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
        q, k, v = self.c_attn(hidden).split(self.hidden_size, dim=-1)  # each [num_tokens, hidden_size]
        return self.c_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous()))


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
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size,
                                _weight=vocab_parameter(config.vocab_size, config.hidden_size))
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, hidden_size]
        for block in self.h:
            hidden = block(hidden)
        return self.ln_f(hidden)


class GPT2ForCausalLM(nn.Module):
    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        self.config = model_config
        self.transformer = GPT2Model(model_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] float32 (lm_head tied to wte; a view
        of logits over 50304 padded rows for GPT-2's 50257: see roseray.layers.vocab)."""
        return vocab_logits(hidden, self.transformer.wte.weight).float()

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
