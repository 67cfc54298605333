"""Piecewise CUDA graphs for steps that carry prefill chunks.

A decode-only step replays one CUDA graph of the whole forward. A step with a prefill
chunk cannot: its attention grid depends on the step's query lengths. Run eagerly, such
a step pays Python and kernel-launch overhead for every layer whatever its size, and
every running stream waits for it (the ITL tail under load). Here the forward of a
token bucket is captured as `num_layers + 1` graphs split at attention: each graph runs
everything between two attentions (norms, projections, RoPE, KV append, MLP), and
attention runs eagerly between them, reading the step's own lengths and block tables
and writing into a buffer that the next graph reads. A mixed step then costs the
attention launches plus the graph replays.

Static buffers: token ids, positions and the slot mapping (read inside the graphs), and
one query and one output buffer shared by every layer and bucket (each graph ends by
copying its layer's rotated queries into the first; attention writes the second; the
next graph reads it before the next attention overwrites it). Padding rows beyond the
step's tokens carry slot -1 (the KV append skips them) and their outputs are never read.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from roseray.layers.attention import Attention, AttentionBackend, AttentionMetadata, attention_metadata, attention_split

logger = logging.getLogger(__name__)


# Buckets double up to here; above it a step's GEMMs cost about in proportion to its tokens, so
# padding to the next power of two could double a step's time (a 2064-token step ran as 4096)
FINE_BUCKETS_FROM = 512
BUCKETS_PER_DOUBLING = 8  # above FINE_BUCKETS_FROM: a step is padded by less than 1/8 of its tokens


def token_buckets(max_tokens: int, smallest: int = 32) -> list[int]:
    """Powers of two from `smallest` up to FINE_BUCKETS_FROM, then BUCKETS_PER_DOUBLING evenly
    spaced buckets per doubling, then `max_tokens` itself as the largest bucket (37 up to 8192).
    More buckets cost capture time and no memory to speak of (the graphs share one pool,
    captured largest first)."""
    buckets, size = [], smallest
    while size < max_tokens:
        buckets.append(size)
        if size < FINE_BUCKETS_FROM:
            size *= 2
        else:
            size += (1 << (size.bit_length() - 1)) // BUCKETS_PER_DOUBLING
    return buckets + [max_tokens]


class PiecewiseGraph:
    """The forward of `num_tokens` (padded) tokens as graphs split at every attention."""

    def __init__(self, num_tokens: int, query: torch.Tensor, out: torch.Tensor) -> None:
        self.num_tokens = num_tokens
        self.query, self.out = query, out  # [num_tokens, num_heads, head_dim] views of the shared buffers
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.layers: list[Attention] = []  # the attention run after each piece but the last
        self.hidden: torch.Tensor | None = None  # the forward's output, written by the last piece

    def capture(self, model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                pool, stream: torch.cuda.Stream) -> None:
        def split(layer: Attention, q: torch.Tensor) -> torch.Tensor:
            self.query.copy_(q)
            self.pieces[-1].capture_end()
            self.layers.append(layer)
            self._begin(pool)
            return self.out

        with torch.cuda.stream(stream):
            self._begin(pool)
            with attention_metadata(meta), attention_split(split):
                self.hidden = model(ids, positions)
            self.pieces[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)

    def _begin(self, pool) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        self.pieces.append(graph)

    def replay(self, backend: AttentionBackend, meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
        """Replay for a step of `num_tokens` real tokens whose inputs are in the static
        buffers; `meta` holds the step's own lengths and tables for the attention calls."""
        pieces, q, out = self.pieces, self.query[:num_tokens], self.out[:num_tokens]
        for i, layer in enumerate(self.layers):
            pieces[i].replay()
            backend.forward(q, layer.k_cache, layer.v_cache, meta, layer.scale, out=out, **layer.options())
        pieces[-1].replay()
        return self.hidden[:num_tokens]


class PiecewiseGraphs:
    """Every token bucket of a model's mixed steps, with the static input buffers."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, max_tokens: int, block_size: int,
                 num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.backend, self.block_size = model, backend, block_size
        self.buckets = token_buckets(max_tokens)
        self.query = torch.zeros((max_tokens, num_heads, head_dim), dtype=dtype, device=device)
        self.out = torch.zeros_like(self.query)
        self.ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.graphs: dict[int, PiecewiseGraph] = {}
        self.num_replays = 0

    def bucket_for(self, num_tokens: int) -> int:
        """The smallest bucket that holds `num_tokens` (0: none, run eagerly)."""
        return next((bucket for bucket in self.buckets if bucket >= num_tokens), 0)

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        device = self.ids.device
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        for bucket in reversed(self.buckets):  # largest first: the smaller ones fit in its memory
            # one token per sequence, each attending to itself: a valid eager warm-up of every kernel
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:bucket],
                query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=device),
                seq_lens=torch.ones(bucket, dtype=torch.int32, device=device),
                block_tables=torch.zeros((bucket, 1), dtype=torch.int32, device=device),
                max_query_len=1, max_seq_len=1, num_seqs=bucket, block_size=self.block_size)
            ids, positions = self.ids[:bucket], self.positions[:bucket]
            with attention_metadata(meta):
                self.model(ids, positions)  # warm-up: compiles, cuBLAS workspaces
            torch.cuda.synchronize(device)
            graph = PiecewiseGraph(bucket, self.query[:bucket], self.out[:bucket])
            graph.capture(self.model, ids, positions, meta, pool, stream)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(device)
        logger.info("captured piecewise CUDA graphs for mixed steps of up to %d tokens (%d buckets) in %.1f s",
                    self.buckets[-1], len(self.buckets), time.perf_counter() - started)

    def run(self, bucket: int, ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The forward of one mixed step (hidden states of its tokens)."""
        n = ids.shape[0]
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:bucket].fill_(-1)
        self.num_replays += 1
        return self.graphs[bucket].replay(self.backend, meta, n)
