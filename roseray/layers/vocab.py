"""The output projection over the vocabulary, with its rows padded in storage.

An odd vocabulary (GPT-2's 50257) makes the logits' row stride odd, and cuBLAS then falls
back to kernels without Hopper's aligned tiles, several times slower (BENCHMARKS.md). So the
weight's storage holds `padded_vocab_size` rows (zeros past the vocabulary): the parameter
itself is the [vocab_size, hidden] view of its first rows, so checkpoints load, embeddings
look up and ties share it as before, and `vocab_logits` multiplies by the padded rows and
returns the [num_rows, vocab_size] view of the result. Nothing downstream sees a padded column.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_PADDING = 64  # rows; 64 keeps bf16 and fp32 logits rows 128-byte aligned


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_PADDING) -> int:
    return -(-vocab_size // multiple) * multiple


def vocab_parameter(vocab_size: int, hidden_size: int) -> nn.Parameter:
    """A [vocab_size, hidden_size] parameter whose storage has padded_vocab_size zero-filled rows
    (made on the default device and dtype, like any parameter built under build_model)."""
    storage = torch.zeros(padded_vocab_size(vocab_size), hidden_size)  # [padded_vocab, hidden]
    return nn.Parameter(storage[:vocab_size])


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [num_rows, hidden_size] x weight [vocab_size, hidden_size]^T -> [num_rows, vocab_size],
    through the padded rows behind `weight` when its storage has them (a view of a padded matmul)."""
    vocab_size, hidden_size = weight.shape
    padded = padded_vocab_size(vocab_size)
    has_padding = (padded != vocab_size and weight.is_contiguous() and weight.storage_offset() == 0
                   and weight.untyped_storage().nbytes() >= padded * hidden_size * weight.element_size())
    if not has_padding:
        return F.linear(hidden, weight)
    return F.linear(hidden, weight.as_strided((padded, hidden_size), (hidden_size, 1)))[:, :vocab_size]
