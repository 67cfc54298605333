"""The cache-less prefill forward of a few prompts through a checkpoint roseray loads (on CPU, fp32 unless
told): what the tensor-parallel tests compare across ranks and methods. Light to import (no transformers),
for the processes those tests start."""

from __future__ import annotations

import random

import torch

from roseray.layers.attention import AttentionMetadata, TorchAttentionBackend, attention_metadata, set_attention_backend
from roseray.models.loader import load_model, load_model_config


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(3, 20))] for _ in range(3)]


def prefill_logits(path, batch, **load_args) -> torch.Tensor:
    """The last position's logits of each prompt, from a cache-less forward of the batch."""
    set_attention_backend(TorchAttentionBackend())
    model = load_model(load_model_config(str(path)), str(path), "cpu", torch.float32, **load_args)
    lens = [len(p) for p in batch]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int32), query_start_loc=torch.tensor(starts).int(),
        seq_lens=torch.tensor(lens).int(), block_tables=torch.zeros((len(batch), 1), dtype=torch.int32),
        max_query_len=max(lens), max_seq_len=max(lens), num_seqs=len(batch), block_size=16)
    ids = torch.tensor([t for p in batch for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad(), attention_metadata(meta):
        hidden = model(ids, positions)
        return model.compute_logits(hidden[torch.tensor(starts[1:]) - 1])
