"""The staging buffer's layout: where a step's inputs sit in the one int32 buffer the host fills
and copies to the device (see roseray.engine.model_runner), and the plan of a step's device
work (StepPlan) that tensor-parallel ranks receive with it."""

from __future__ import annotations

import torch

ALIGN = 16  # int32 elements: staging-buffer regions start 64-byte aligned


def cuda_graph_buckets(max_batch: int) -> list[int]:
    buckets = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({b for b in buckets if b <= max_batch} | {max_batch})


def fill_in_flight(ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> None:
    """ids[dst] = tokens[src] on the device: a step's placeholders for tokens that the step
    still in flight samples (dst, src: int32 positions from the staging buffer)."""
    ids.index_copy_(0, dst.long(), tokens.index_select(0, src.long()).to(ids.dtype))


class DecodeLayout:
    """Where a decode step's inputs sit in the staging buffer: int32 regions of `stride`
    entries each (ids, positions, slots, lengths, in-flight source rows), then the block
    tables, [batch, num_block_cols]. Fixed, so captured graphs read them in place."""

    __slots__ = ("stride", "ids", "pos", "slot", "lens", "src", "tables")

    def __init__(self, max_num_seqs: int) -> None:
        self.stride = -(-max_num_seqs // ALIGN) * ALIGN
        self.ids, self.pos, self.slot, self.lens, self.src, self.tables = (i * self.stride for i in range(6))

    def pad(self, buffer, first: int, end: int) -> None:
        """Rows first..end-1 of the per-row regions of `buffer` (numpy or torch) as padding:
        slot -1 (nothing written to the cache), length 0, no in-flight source."""
        for start, value in ((self.ids, 0), (self.pos, 0), (self.slot, -1), (self.lens, 0), (self.src, -1)):
            buffer[start + first: start + end] = value


class StepInputs:
    """Host-side arrays of one step (views into the staging buffer) plus bookkeeping."""

    __slots__ = ("num_tokens", "num_seqs", "max_query_len", "max_seq_len", "num_block_cols", "logits_indices",
                 "sample_mask", "num_pending", "pending_offset", "logits_offset", "offsets")


# A step's device work as ints: (DECODE, used, graph bucket, rows, block-table columns, longest sequence,
# sequences) or (PREFILL, used, piecewise bucket, tokens, sequences, longest query, longest sequence,
# block-table columns, in-flight rows, their offset, logits offset, logits rows, six region offsets).
StepPlan = tuple[int, ...]
STOP, DECODE, PREFILL = 0, 1, 2
PLAN_LENGTHS = {STOP: 2, DECODE: 7, PREFILL: 18}
