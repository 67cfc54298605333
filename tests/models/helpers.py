"""What the model and kernel tests share: attention metadata for one step over a paged KV cache."""

import torch

from roseray.layers.attention import AttentionMetadata


def step_metadata(steps: list[tuple[list[int], int, int]], block_size: int = 4) -> AttentionMetadata:
    """Metadata for one step; each sequence is (block_table, num_cached_tokens, num_new_tokens)."""
    slots, query_start, seq_lens = [], [0], []
    for table, start, count in steps:
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(start, start + count)]
        query_start.append(query_start[-1] + count)
        seq_lens.append(start + count)
    width = max(len(table) for table, _, _ in steps)
    tables = [table + [-1] * (width - len(table)) for table, _, _ in steps]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),  # [num_seqs, width]
        max_query_len=max(count for _, _, count in steps),
        max_seq_len=max(seq_lens),
        num_seqs=len(steps),
        block_size=block_size,
    )
