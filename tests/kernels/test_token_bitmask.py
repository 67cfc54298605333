"""The grammar-mask kernel against its torch reference and against a mask built bit by bit.

On CPU the kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1); on
CUDA the same checks run at a real vocabulary size, in bf16 too."""

from __future__ import annotations

import pytest
import torch

from roseray.engine.logits_processors import apply_token_bitmask
from roseray_kernels.token_bitmask import apply_token_bitmask_

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]
VOCABS = [151_936, 100] if ON_CUDA else [100, 4096 + 37]


def _random_bitmask(rows: int, vocab: int, num_words: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bitmask [rows, num_words] int32, the allowed tokens [rows, vocab] bool it encodes)."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, num_words * 32, generator=generator) < 0.3
    weights = (torch.ones(32, dtype=torch.int64) << torch.arange(32))
    words = (allowed.view(rows, num_words, 32).to(torch.int64) * weights).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the bits as int32
    return bitmask, allowed[:, :vocab]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_kernel_masks_exactly_the_forbidden_tokens_of_the_named_rows(dtype, vocab):
    batch, rows = 6, torch.tensor([4, 0, 3], dtype=torch.int64)
    num_words = (vocab + 31) // 32
    bitmask, allowed = _random_bitmask(len(rows), vocab, num_words, seed=vocab)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    want = logits.clone()
    for i, row in enumerate(rows.tolist()):
        want[row][~allowed[i].to(DEVICE)] = float("-inf")
    got, reference = logits.clone(), logits.clone()
    apply_token_bitmask_(got, bitmask.to(DEVICE), rows.to(DEVICE))
    apply_token_bitmask(reference, bitmask.to(DEVICE), rows.to(DEVICE))
    assert torch.equal(got, want)  # rows 1, 2 and 5 untouched, masked values exactly -inf
    assert torch.equal(reference, want)


def test_tokens_past_the_mask_are_forbidden():
    """A model vocabulary wider than the tokenizer's mask (padded embeddings): the extra columns get -inf."""
    vocab, num_words = 100, 2  # the mask covers 64 tokens
    bitmask = torch.full((1, num_words), -1, dtype=torch.int32, device=DEVICE)
    for fn in (apply_token_bitmask_, apply_token_bitmask):
        logits = torch.zeros(2, vocab, device=DEVICE)
        fn(logits, bitmask, torch.tensor([1], device=DEVICE))
        assert torch.isinf(logits[1, 64:]).all() and (logits[1, :64] == 0).all() and (logits[0] == 0).all()


def test_no_masked_rows_is_a_no_op():
    logits = torch.randn(3, 50, device=DEVICE)
    before = logits.clone()
    empty = torch.empty(0, 2, dtype=torch.int32, device=DEVICE)
    apply_token_bitmask_(logits, empty, torch.empty(0, dtype=torch.int64, device=DEVICE))
    apply_token_bitmask(logits, empty, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(logits, before)
