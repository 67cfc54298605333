"""Grammar masks on the logits: the tokens a row's grammar forbids get -inf, in place.

A constrained row's allowed tokens come as a bitmask of int32 words (bit j of word w set =
token 32 * w + j allowed: the layout grammar engines fill on the host). One launch covers
every constrained row of the batch, whatever rows of the logits they are (`rows` names them);
unconstrained rows are not touched. Tokens past the mask's last word (a model vocabulary wider
than the tokenizer's) are forbidden.

grid (constrained rows, vocab blocks): each program reads BLOCK // 32 words of its row's
mask, expands them to BLOCK bits and writes -inf where a bit is clear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits per program
NUM_WARPS = 4


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [batch, vocab_size], row stride stride_row, any float dtype; written in place
    bitmask_ptr,  # [num_masked, num_words] int32, contiguous
    rows_ptr,  # [num_masked] int64: the logits row of each mask row
    vocab_size,
    num_words,
    stride_row,
    BLOCK: tl.constexpr,
):
    mask_row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    row = tl.load(rows_ptr + mask_row)
    cols = start + tl.arange(0, BLOCK)
    words = tl.load(bitmask_ptr + mask_row.to(tl.int64) * num_words + cols // 32, mask=cols < num_words * 32,
                    other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_row + cols, tl.full([BLOCK], float("-inf"), tl.float32),
             mask=(cols < vocab_size) & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [B, V] (unit column stride); bitmask [R, W] int32 on the logits' device; rows [R] int64."""
    num_masked, num_words = bitmask.shape
    if num_masked == 0:
        return
    vocab_size = logits.shape[1]
    grid = (num_masked, triton.cdiv(vocab_size, BLOCK))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows, vocab_size, num_words, logits.stride(0),
                                      BLOCK=BLOCK, num_warps=NUM_WARPS)
