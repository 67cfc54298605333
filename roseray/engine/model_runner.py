"""Model runner: a scheduled batch -> device tensors -> forward -> logits.

Per step, everything the layers need (input ids, positions, slot mapping, query start
locations, sequence lengths, block tables) is computed vectorised on the host into one
int32 staging buffer, copied to the device once, and sliced into views. Every layer's
KV append reuses the same `slot_mapping`.

Decode-only steps (one token per request) take their own path with a fixed layout in the
staging buffer (`DecodeLayout`): their forward also fills in the tokens the step in flight
is sampling (from `decode_tokens`, where the previous decode step left its argmax, or a
copy of the sampler's tokens), computes the logits of every row and their argmax. On CUDA
that whole forward is one CUDA graph per batch-size bucket (padding rows carry slot -1 and
sequence length 0), so a greedy decode step launches an H2D copy, a block-table copy and
a graph replay, nothing more.

Host staging is double-buffered on CUDA: with async scheduling the host prepares step N+1
while step N's host-to-device copy may still be queued behind step N-1 on the stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from roseray.config import EngineConfig, ModelConfig
from roseray.distributed import all_reduce_min
from roseray.engine.block_manager import BlockManager
from roseray.engine.captured_graphs import CapturedGraphs
from roseray.engine.kv_cache import (
    allocate_kv_cache,
    choose_kv_cache_dtype,
    kv_bytes_per_block,
    profile_gpu_blocks,
    set_kv_cache_scales,
)
from roseray.engine.piecewise_graphs import PiecewiseGraphs
from roseray.engine.scheduler import SchedulerOutput
from roseray.engine.step_inputs import (
    ALIGN,
    DECODE,
    PREFILL,
    DecodeLayout,
    StepInputs,
    StepPlan,
    cuda_graph_buckets,
    fill_in_flight,
)
from roseray.layers.attention import (
    Attention,
    AttentionMetadata,
    TorchAttentionBackend,
    attention_metadata,
    set_attention_backend,
)

logger = logging.getLogger(__name__)


def make_attention_backend(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    from roseray.layers.triton_backend import TritonAttentionBackend  # Triton is optional on CPU

    return TritonAttentionBackend()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model: nn.Module,
                 device: torch.device, dtype: torch.dtype, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = (max_model_len + self.block_size - 1) // self.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.backend = make_attention_backend(config.attention_backend, device)
        set_attention_backend(self.backend)
        self.kv_cache_dtype = choose_kv_cache_dtype(config.kv_cache_dtype, dtype, device, self.backend.name)
        set_kv_cache_scales(self.attention_layers, getattr(model, "kv_cache_scales", {}), config.kv_cache_scale,
                            self.kv_cache_dtype)

        # One int32 staging buffer for everything a step sends to the device (two on CUDA,
        # used in turn: see the module docstring).
        self.decode_layout = DecodeLayout(self.max_num_seqs)
        capacity = max(3 * self.max_num_tokens + 5 * self.max_num_seqs + 1 + self.max_num_seqs * self.max_blocks_per_seq
                       + 8 * ALIGN, self.decode_layout.tables + self.max_num_seqs * self.max_blocks_per_seq)
        pin = device.type == "cuda"
        self._host_buffers = [torch.zeros(capacity, dtype=torch.int32, pin_memory=pin) for _ in range(1 + pin)]
        self._host_arrays = [b.numpy() for b in self._host_buffers]
        self._turn = 0
        self._host_buffer, self._host = self._host_buffers[0], self._host_arrays[0]
        host = self._host_buffer
        self._device_buffer = host if device.type == "cpu" else torch.zeros_like(host, device=device)
        self._arange = np.arange(self.max_num_tokens + 1, dtype=np.int32)
        self._all_rows = np.ones(self.max_num_seqs, dtype=bool)
        # The argmax of the latest decode step's rows; the next decode step reads the tokens
        # still in flight from here (`_decode_forward`).
        self.decode_tokens = torch.zeros(self.max_num_seqs, dtype=torch.int64, device=device)
        self._decode_qsl = torch.arange(self.max_num_seqs + 1, dtype=torch.int32, device=device)

        self.step_channel = None  # tensor parallelism: rank 0 sends each step's plan to the other ranks
        self.num_blocks = all_reduce_min(self._decide_num_blocks())  # every rank's cache holds the same blocks
        self.kv_cache = allocate_kv_cache(self.attention_layers, self.num_blocks, self.block_size, self.kv_cache_dtype,
                                          device)
        self.captured = CapturedGraphs()
        self.use_cuda_graphs = device.type == "cuda" and not config.enforce_eager and self.backend.name == "triton"

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        return self.captured.decode

    @property
    def piecewise(self) -> PiecewiseGraphs | None:
        return self.captured.piecewise

    # ---- KV cache ----------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.attention_layers, self.kv_cache_dtype, self.block_size)

    def _decide_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cpu":
            budget = int(self.config.cpu_kv_cache_gib * 2**30) // self.bytes_per_block
            enough = self.max_num_seqs * self.max_blocks_per_seq  # every slot at full length
            return max(1, min(budget, enough))
        return profile_gpu_blocks(self.device, self.config.gpu_memory_utilization, self.bytes_per_block,
                                  self._profile_forward)

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """A forward at the largest step size, without a KV cache, plus logits and
        softmax for max_num_seqs rows: the activation peak the cache must leave room for (the
        sampler's fp32 copy of the logits included, also where the model returns bf16 ones)."""
        num_tokens = self.config.max_num_batched_tokens
        seq_lens = [min(self.max_model_len, num_tokens - i) for i in range(0, num_tokens, self.max_model_len)]
        hidden = self._dummy_forward(seq_lens, seq_lens)
        rows = hidden[-1:].expand(self.max_num_seqs, -1)
        torch.softmax(self.model.compute_logits(rows).float(), dim=-1)

    def _dummy_forward(self, query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
        """A forward of made-up sequences that writes nothing to the KV cache (every slot
        is -1); with a cache bound, attention reads block 0 onwards, which holds no request."""
        num_tokens, d = sum(query_lens), self.device
        qsl = torch.tensor([0] + np.cumsum(query_lens).tolist(), dtype=torch.int32, device=d)
        num_block_cols = max(1, (max(seq_lens) + self.block_size - 1) // self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int32, device=d), query_start_loc=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=d),
            block_tables=torch.zeros((len(seq_lens), num_block_cols), dtype=torch.int32, device=d),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_seqs=len(seq_lens),
            block_size=self.block_size)
        input_ids = torch.zeros(num_tokens, dtype=torch.int32, device=d)
        positions = torch.cat([torch.arange(s - q, s, device=d) for q, s in zip(query_lens, seq_lens)]).int()
        with attention_metadata(meta):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run prefill, mixed and decode batches through the paged path once, so that
        kernels are compiled before the first request rather than during it."""
        if self.device.type != "cuda":
            return
        from roseray_kernels.paged_attention import split_warm_up_lengths  # Triton is optional on CPU
        started = time.perf_counter()
        budget = min(self.config.max_num_batched_tokens, self.max_model_len)
        cap = lambda n: max(1, min(n, self.max_model_len))  # noqa: E731 - positions must stay in range
        long_len = cap(budget // 2)
        self._dummy_forward([long_len, cap(17), cap(3)], [long_len, cap(17), cap(3)])  # prefill only
        mixed = [cap(40), cap(300), cap(38), long_len]  # decodes + chunks on a cached prefix
        self._dummy_forward([1, 1, min(5, mixed[2]), max(1, long_len // 2)], mixed)
        self._dummy_forward([1] * 5, [cap(n) for n in (1, 17, 100, 1000, 7)])  # decode, eager
        # every split-KV count a mixed step (and, without graphs, a decode step) can pick: each is
        # its own compile, which the first step to need it would otherwise wait for
        for keys in split_warm_up_lengths(self.max_model_len):
            self._dummy_forward([min(2, keys)], [keys])
            if self.config.enforce_eager:
                self._dummy_forward([1], [keys])
        # What a step runs outside the graphs, at every decode batch size (lm_head GEMM, argmax, the
        # in-flight fill): kernels differ by size, and CUDA loads a kernel's module at its first
        # launch, which would otherwise land inside the first requests' TTFT.
        n, d = self.max_num_seqs, self.device
        rows = torch.zeros((n, self.model_config.hidden_size), dtype=self.dtype, device=d)
        ids, tokens = torch.zeros(n, dtype=torch.int32, device=d), torch.zeros(n, dtype=torch.int64, device=d)
        for num_rows in cuda_graph_buckets(n):
            self.model.compute_logits(rows[:num_rows]).argmax(dim=-1)
            index = torch.arange(num_rows, dtype=torch.int32, device=d)
            fill_in_flight(ids, index, index, tokens[:num_rows])
        torch.cuda.synchronize(d)
        logger.info("kernels warmed up in %.1f s", time.perf_counter() - started)

    @torch.inference_mode()
    def logits_for_warm_up(self) -> torch.Tensor:
        """Logits of max_num_seqs rows as the model returns them (dtype, padded row stride):
        what the sampler compiles its kernels for before the first request."""
        hidden = torch.zeros(self.max_num_seqs, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        return self.model.compute_logits(hidden)

    # ---- step ----------------------------------------------------------------------------
    def _next_staging(self) -> np.ndarray:
        """The host staging array for the next step (alternating on CUDA)."""
        self._turn ^= len(self._host_buffers) - 1
        self._host_buffer, self._host = self._host_buffers[self._turn], self._host_arrays[self._turn]
        if self.device.type == "cpu":
            self._device_buffer = self._host_buffer
        return self._host

    def prepare(self, batch: SchedulerOutput, block_manager: BlockManager) -> tuple[StepInputs, int]:
        """Fill the staging buffer for a step with prefill chunks (any mix of chunks and
        decodes); returns the layout and how much of the buffer is used."""
        host = self._next_staging()
        reqs, num_new = batch.requests, batch.num_new_tokens
        num_seqs = len(reqs)
        query_lens = np.fromiter(num_new, dtype=np.int32, count=num_seqs)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int32, count=num_seqs)
        rows = np.fromiter((r.row for r in reqs), dtype=np.int32, count=num_seqs)
        num_tokens = int(query_lens.sum())
        seq_lens = starts + query_lens
        num_block_cols = int((seq_lens.max() + self.block_size - 1) // self.block_size)

        sizes = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * num_block_cols]
        views, offsets, offset = [], [], 0
        for size in sizes:
            views.append(host[offset: offset + size])
            offsets.append(offset)
            offset += -(-size // ALIGN) * ALIGN  # every region starts 64-byte aligned (one Triton variant)
        ids_v, pos_v, slot_v, qsl_v, lens_v, tables_v = views

        tables = block_manager.block_tables[rows, :num_block_cols]  # [num_seqs, num_block_cols]
        # positions: each sequence's new tokens continue from its computed prefix
        qsl_v[0] = 0
        np.cumsum(query_lens, out=qsl_v[1: num_seqs + 1])
        token_seq = np.repeat(np.arange(num_seqs, dtype=np.int32), query_lens)  # [num_tokens]
        positions = self._arange[:num_tokens] - (qsl_v[:num_seqs] - starts)[token_seq]
        pos_v[:] = positions
        slot_v[:] = tables[token_seq, positions // self.block_size] * self.block_size + positions % self.block_size
        ids_v[:] = [t for r, s, n in zip(reqs, starts.tolist(), num_new) for t in r.token_ids[s: s + n]]
        lens_v[:] = seq_lens
        tables_v.reshape(num_seqs, num_block_cols)[:] = tables

        last = qsl_v[1: num_seqs + 1] - 1
        # Input tokens the step in flight is still sampling (placeholders): the device fills
        # them in from that step's sampled ids (row `sample_row`).
        pending = [i for i, r in enumerate(reqs) if r.token_ids[-1] < 0]
        if pending:
            host[offset: offset + len(pending)] = last[pending]
            host[offset + len(pending): offset + 2 * len(pending)] = [reqs[i].sample_row for i in pending]
        pending_offset, offset = offset, offset + 2 * len(pending)
        # Rows whose chunk reaches the request's end: their last hidden state gives logits.
        sample_mask = (seq_lens == np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int32, count=num_seqs))
        logits_indices = last[sample_mask]
        host[offset: offset + len(logits_indices)] = logits_indices
        logits_offset, offset = offset, offset + len(logits_indices)
        step = StepInputs()
        step.num_tokens, step.num_seqs = num_tokens, num_seqs
        step.max_query_len = int(query_lens.max())
        step.max_seq_len = int(seq_lens.max())
        step.num_block_cols = num_block_cols
        step.logits_indices = logits_indices
        step.sample_mask = sample_mask
        step.num_pending, step.pending_offset = len(pending), pending_offset
        step.logits_offset = logits_offset
        step.offsets = offsets
        return step, offset

    def prepare_decode(self, batch: SchedulerOutput, block_manager: BlockManager,
                       num_rows: int) -> tuple[int, int, int]:
        """Fill the staging buffer's DecodeLayout for a decode-only batch padded to `num_rows`
        (slot -1, length 0, no in-flight source); returns (entries used, block-table columns,
        longest sequence)."""
        host, lay = self._next_staging(), self.decode_layout
        reqs = batch.requests
        num_seqs = len(reqs)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int32, count=num_seqs)
        rows = np.fromiter((r.row for r in reqs), dtype=np.int32, count=num_seqs)
        last_ids = np.fromiter((r.token_ids[-1] for r in reqs), dtype=np.int32, count=num_seqs)
        max_seq_len = int(starts.max()) + 1
        num_block_cols = (max_seq_len + self.block_size - 1) // self.block_size
        tables = block_manager.block_tables[rows, :num_block_cols]
        block_size = self.block_size
        host[lay.ids: lay.ids + num_seqs] = last_ids
        host[lay.pos: lay.pos + num_seqs] = starts
        host[lay.slot: lay.slot + num_seqs] = tables[self._arange[:num_seqs], starts // block_size] * block_size \
            + starts % block_size
        host[lay.lens: lay.lens + num_seqs] = starts + 1
        src = host[lay.src: lay.src + num_seqs]
        src[:] = -1
        pending = np.flatnonzero(last_ids < 0).tolist()  # placeholders: the step in flight samples them
        if pending:
            src[pending] = [reqs[i].sample_row for i in pending]
        end = lay.tables + num_rows * num_block_cols
        host[lay.tables: lay.tables + num_seqs * num_block_cols] = tables.reshape(-1)
        if num_rows > num_seqs:  # padding rows
            lay.pad(host, num_seqs, num_rows)
            host[lay.tables + num_seqs * num_block_cols: end] = 0
        return end, num_block_cols, max_seq_len

    def _copy_staging(self, used: int) -> None:
        if self.device.type == "cuda":
            self._device_buffer[:used].copy_(self._host_buffer[:used], non_blocking=True)

    @torch.inference_mode()
    def prepare_run(self, batch: SchedulerOutput, block_manager: BlockManager) -> Callable[..., tuple]:
        """The host's part of a step now (its inputs into the staging buffer, their copy queued);
        returns its launch: `launch(in_flight_tokens)` -> logits [num_sampling, vocab] (the
        model's dtype) for the requests whose scheduled tokens reach their end, the boolean
        mask of those, and their argmax when the step computed it (decode steps), else None.
        `in_flight_tokens`: the device token ids sampled by the step still in flight. Between the
        two the device may be given other work (a held step's sampling).
        The device part runs from a StepPlan (ints) and the staging buffer: under tensor
        parallelism `launch` first sends both to the other ranks, which run the same plan."""
        if batch.num_tokens == len(batch):
            num_seqs = len(batch)
            bucket = self._graph_bucket(num_seqs)
            used, num_block_cols, max_seq_len = self.prepare_decode(batch, block_manager, bucket or num_seqs)
            plan = (DECODE, used, bucket, bucket or num_seqs, num_block_cols, max_seq_len, num_seqs)
            sample_mask = self._all_rows[:num_seqs]
        else:
            piece_bucket = 0 if self.piecewise is None else self.piecewise.bucket_for(batch.num_tokens)
            step, used = self.prepare(batch, block_manager)
            plan = (PREFILL, used, piece_bucket, step.num_tokens, step.num_seqs, step.max_query_len,
                    step.max_seq_len, step.num_block_cols, step.num_pending, step.pending_offset,
                    step.logits_offset, len(step.logits_indices), *step.offsets)
            sample_mask = step.sample_mask
        self._copy_staging(used)

        @torch.inference_mode()
        def launch(in_flight_tokens: torch.Tensor | None) -> tuple[torch.Tensor, np.ndarray, torch.Tensor | None]:
            if self.step_channel is not None:
                self.step_channel.send(plan, self._device_buffer, in_flight_tokens, self.decode_tokens)
            logits, tokens = self.run_plan(plan, in_flight_tokens)
            return logits, sample_mask, tokens

        return launch

    def run_plan(self, plan: StepPlan, in_flight_tokens: torch.Tensor | None):
        """The device part of a step from its plan and the staging buffer already on the device:
        (logits of the rows that sample, their argmax for decode steps, else None)."""
        if plan[0] == DECODE:
            return self._run_decode(plan, in_flight_tokens)
        return self._run_prefill(plan, in_flight_tokens), None

    def _run_prefill(self, plan: StepPlan, in_flight_tokens: torch.Tensor | None) -> torch.Tensor:
        (_, _, piece_bucket, t, s, max_query_len, max_seq_len, num_block_cols, num_pending, pending_offset,
         logits_offset, num_logits, o_ids, o_pos, o_slot, o_qsl, o_lens, o_tab) = plan
        buf = self._device_buffer
        ids, pos, slot = buf[o_ids: o_ids + t], buf[o_pos: o_pos + t], buf[o_slot: o_slot + t]
        tables = buf[o_tab: o_tab + s * num_block_cols].view(s, num_block_cols)
        meta = AttentionMetadata(slot, buf[o_qsl: o_qsl + s + 1], buf[o_lens: o_lens + s], tables, max_query_len,
                                 max_seq_len, s, self.block_size)
        indices = buf[logits_offset: logits_offset + num_logits]  # part of the one staging copy
        if num_pending:
            n, first = num_pending, pending_offset
            fill_in_flight(ids, buf[first: first + n], buf[first + n: first + 2 * n], in_flight_tokens)
        if piece_bucket:
            hidden = self.piecewise.run(piece_bucket, ids, pos, slot, meta)
        else:
            with attention_metadata(meta):
                hidden = self.model(ids, pos)
        return self.model.compute_logits(hidden[indices.long()])

    def _run_decode(self, plan: StepPlan, in_flight_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, bucket, num_rows, num_block_cols, max_seq_len, num_seqs = plan
        start = self.decode_layout.tables
        tables = self._device_buffer[start: start + num_rows * num_block_cols].view(num_rows, num_block_cols)
        if in_flight_tokens is not None and in_flight_tokens.data_ptr() != self.decode_tokens.data_ptr():
            self.decode_tokens[: in_flight_tokens.shape[0]].copy_(in_flight_tokens)  # sampled by another path
        if bucket:
            self._g_tables[:bucket, :num_block_cols].copy_(tables)
            self.graphs[bucket].replay()
            logits = self.captured.decode_logits[bucket]
        else:
            logits = self._decode_forward(num_rows, tables, max_seq_len)
        return logits[:num_seqs], self.decode_tokens[:num_seqs]

    def _decode_forward(self, num_rows: int, tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """The forward of a decode step from the DecodeLayout (what a decode graph holds): fill
        in the in-flight tokens, run the model, logits of every row, their argmax into
        `decode_tokens`. Returns the logits."""
        buf, lay = self._device_buffer, self.decode_layout
        ids, pos, slot, lens, src = (buf[o: o + num_rows] for o in (lay.ids, lay.pos, lay.slot, lay.lens, lay.src))
        in_flight = self.decode_tokens.index_select(0, src.clamp(min=0).long()).to(ids.dtype)
        ids = torch.where(src >= 0, in_flight, ids)
        meta = AttentionMetadata(slot, self._decode_qsl[: num_rows + 1], lens, tables, 1, max_seq_len, num_rows,
                                 self.block_size)
        with attention_metadata(meta):
            hidden = self.model(ids, pos)
        logits = self.model.compute_logits(hidden)
        self.decode_tokens[:num_rows] = logits.argmax(dim=-1)
        return logits

    # ---- CUDA graphs ---------------------------------------------------------------------
    def _graph_bucket(self, num_seqs: int) -> int:
        if not self.graphs:
            return 0
        for bucket in self._buckets:
            if bucket >= num_seqs:
                return bucket
        return 0

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        if not self.use_cuda_graphs:
            return
        started = time.perf_counter()
        max_batch = min(self.max_num_seqs, self.config.cuda_graph_max_batch_size)
        self._buckets = cuda_graph_buckets(max_batch)
        self.decode_layout.pad(self._device_buffer, 0, max_batch)  # the capture's forwards write nothing to the cache
        self._g_tables = torch.zeros((max_batch, self.max_blocks_per_seq), dtype=torch.int32, device=self.device)
        pool = None
        logits = self.captured.decode_logits
        for bucket in reversed(self._buckets):  # largest first, so later graphs reuse its pool
            graph = torch.cuda.CUDAGraph()
            self._decode_forward(bucket, self._g_tables[:bucket], self.max_model_len)  # warm-up
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(graph, pool=pool):
                logits[bucket] = self._decode_forward(bucket, self._g_tables[:bucket], self.max_model_len)
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs for decode batch sizes up to %d in %.1f s",
                    len(self.graphs), max_batch, time.perf_counter() - started)
        max_tokens = min(self.max_num_tokens, self.config.cuda_graph_max_tokens)
        if max_tokens > 0:
            mc = self.model_config
            self.captured.piecewise = PiecewiseGraphs(self.model, self.backend, max_tokens, self.block_size,
                                                      self.attention_layers[0].num_heads, mc.head_dim, self.dtype,
                                                      self.device)
            self.captured.piecewise.capture()
