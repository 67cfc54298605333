"""Split-KV on the general (prefill / mixed) paged-attention path against the torch reference.

`num_splits` forces S > 1 (on CPU the launcher always picks 1): each tile's key range is split in the
kernel from the sequence's length, the partials are combined per token row, the sink is counted once
in the combine. Sequences of one step have different prefix lengths (0, shorter than one split, not a
multiple of the split or the cache block), so one compiled S serves them all, as it must for a CUDA
graph replayed on other lengths. Small tiles (16 rows, 16 keys) make several tiles per chunk and
several loop steps per split; S = 16 leaves some splits of short sequences empty.

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on CUDA
the same checks run, plus bf16 at Qwen3-0.6B's geometry and a CUDA graph replayed on other prefixes.
"""

from __future__ import annotations

import pytest
import torch

from roseray.layers.attention import paged_attention_reference
from roseray_kernels.paged_attention import (
    MAX_GENERAL_SPLITS,
    MIN_KEYS_PER_GENERAL_SPLIT,
    KernelConfig,
    general_tiles_bound,
    paged_attention,
    splits_for_grid,
)
from tests.kernels.helpers import rel_err
from tests.kernels.test_attention_options import OPTION_SETS, options_for, run_and_check
from tests.kernels.test_kernels import (
    DEVICE,
    NEEDS_FRESH_PROCESS,
    ON_CUDA,
    TOLERANCE,
    Step,
    paged_attention_module,
)
from tests.kernels.test_kv_fp8 import append_and_reference, check, fp8_step

pytestmark = pytest.mark.skipif(NEEDS_FRESH_PROCESS, reason="Triton was imported before TRITON_INTERPRET=1 was set")
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")

# prefix 0 (fresh prompts), a prefix inside one block, prefixes not a multiple of the block (8) or of a
# split's keys, a decode row and a chunk longer than one tile, beside each other in one step
SEQS = [(0, 23), (37, 9), (50, 1), (5, 17), (0, 3), (61, 30)]


@pytest.fixture
def small_tiles(monkeypatch):
    """Prefill tiles of 16 rows and 16 keys for every head_dim."""
    cfg = KernelConfig(16, num_warps=4, num_stages=1, block_m=16)
    monkeypatch.setattr(paged_attention_module, "PREFILL_CONFIG", cfg)
    monkeypatch.setattr(paged_attention_module, "PREFILL_CONFIG_D256", cfg)


@pytest.mark.parametrize("num_splits", [2, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_split_kv_over_prefixes_of_every_length(group, num_splits, small_tiles):
    step = Step(SEQS, num_kv_heads=2, group=group, head_dim=64, dtype=torch.float32, block_size=8, pad_tokens=3,
                seed=num_splits + group)
    step.append()
    step.check(step.attend(num_splits=num_splits))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_split_kv_head_dims(head_dim, small_tiles):
    step = Step(SEQS, num_kv_heads=1, group=2, head_dim=head_dim, dtype=torch.float32, block_size=16, pad_tokens=1,
                seed=head_dim)
    step.append()
    step.check(step.attend(num_splits=4))


@pytest.mark.parametrize("head_dim", [64, 256])
def test_split_kv_with_the_shipped_tiles(head_dim):
    """The default prefill configs (64 query rows; 64 or 32 keys per step): one tile per chunk here."""
    seqs = [(130, 20), (0, 40), (77, 1), (200, 9)]
    step = Step(seqs, num_kv_heads=2, group=2, head_dim=head_dim, dtype=torch.float32, pad_tokens=2, seed=3)
    step.append()
    step.check(step.attend(num_splits=4))


@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("group", [1, 4])
def test_split_kv_with_options(group, name, small_tiles):
    """Windows (inside a block, over several, longer than any sequence; blocks before every window are
    NaN), softcap, sinks (counted once, in the combine) and all together, over split tiles."""
    step = Step(SEQS, num_kv_heads=2, group=group, head_dim=32, dtype=torch.float32, block_size=8, pad_tokens=3,
                seed=20 + group)
    poisoned = run_and_check(step, options_for(step, OPTION_SETS[name], group), num_splits=4)
    if name in ("window-3", "window-20"):
        assert poisoned > 0, "the step must have blocks outside the window"


@pytest.mark.parametrize("num_splits", [2, 16])
def test_split_kv_with_every_option_and_split_count(num_splits, small_tiles):
    step = Step(SEQS, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32, block_size=8, pad_tokens=2,
                seed=num_splits)
    run_and_check(step, options_for(step, OPTION_SETS["all"]), num_splits=num_splits)


@pytest.mark.parametrize("name", ["plain", "all"])
def test_split_kv_reads_fp8(name, small_tiles):
    """v_scale multiplies each split's accumulator once; k_scale is in the softmax scale as before."""
    step = fp8_step(SEQS, group=2, block_size=8, pad_tokens=3, seed=12)
    options = options_for(step, OPTION_SETS.get(name, {}))
    check(step, append_and_reference(step, options), options, num_splits=4)


@pytest.mark.parametrize("sinks", [False, True])
def test_split_kv_padding(sinks, small_tiles):
    """A sequence with no query rows between two others and at the end (seq_len 0), rows of
    sequences with seq_len 0 (as a padded graph step has) and rows past query_start_loc[-1]:
    zeros, sink or not; the real rows match the reference."""
    seqs = [(20, 13), (0, 0), (9, 18), (0, 1), (0, 2), (0, 0)]
    step = Step(seqs, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32, block_size=8, pad_tokens=5, seed=7)
    for i in (1, 3, 4, 5):
        step.meta.seq_lens[i] = 0
    step.slot_mapping[31:] = -1
    step.num_real = 31  # the rows of the zero-length sequences (31, 32, 33) must come out zero like padding
    options = options_for(step, OPTION_SETS["sinks"]) if sinks else {}
    step.append()
    out = step.attend(num_splits=8, **options)
    ref = paged_attention_reference(step.query.float(), step.k_cache, step.v_cache, step.meta, step.scale, **options)
    assert not out.isnan().any(), "NaN in the output (an unwritten row)"
    assert rel_err(out[:31], ref[:31]) < TOLERANCE[torch.float32]
    assert (out[31:] == 0).all(), "rows of empty sequences and padding rows must be zero"


def test_one_split_is_the_single_pass_without_combine(monkeypatch):
    """S = 1 (the CPU choice, and any large grid) launches the general kernel alone."""
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the combine kernel was launched for one split")

    monkeypatch.setattr(paged_attention_module, "combine_splits_kernel", NoLaunch())
    step = Step([(40, 12), (0, 9)], num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32, block_size=8, seed=1)
    step.append()
    step.check(step.attend())
    step.check(step.attend(num_splits=1))


def test_split_choice_follows_the_grid_and_the_keys():
    """The host's choice on an H100 (132 SMs) at Qwen3-0.6B's geometry (8 KV heads, groups of 2:
    32-token tiles): a short chunk after a long prefix splits, a long chunk or a short context does not."""
    def choose(chunk: int, prefix: int, num_seqs: int = 1) -> int:
        programs = general_tiles_bound(chunk, num_seqs, 32) * 8
        return splits_for_grid(programs, prefix + chunk, 132, MIN_KEYS_PER_GENERAL_SPLIT, MAX_GENERAL_SPLITS)

    assert choose(128, 2048) == choose(128, 6144) == 8
    assert choose(512, 6144) == 2
    assert choose(2048, 6144) == 1  # 65 tiles x 8 heads fill the GPU twice already
    assert choose(128, 0) == 1  # too few keys to split
    assert choose(128, 6144, num_seqs=40) == 1  # a mixed batch of many sequences
    for chunk in (16, 64, 128, 256, 512, 1024):
        for keys in (300, 1000, 5000, 40000):
            s = choose(chunk, keys)
            assert s & (s - 1) == 0 and 1 <= s <= MAX_GENERAL_SPLITS


# ---------------------------------------------------------------------------------------
# CUDA: bf16 at Qwen3-0.6B's attention geometry, and a CUDA graph replayed on other prefixes
# ---------------------------------------------------------------------------------------
QWEN3 = dict(num_kv_heads=8, group=2, head_dim=128)


@cuda_only
@pytest.mark.parametrize("num_splits", [None, 2, 16])
def test_real_size_chunk_after_long_prefix(num_splits):
    """None: the launcher's own choice (more than one split here)."""
    step = Step([(6144, 128), (2000, 1), (0, 64)], **QWEN3, dtype=torch.bfloat16, pad_tokens=2, seed=5)
    if num_splits is None:
        assert paged_attention_module.choose_general_splits(
            step.query.shape[0], 3, 32, 8, step.meta.max_seq_len, step.query.device) > 1
    step.append()
    step.check(step.attend(num_splits=num_splits))


@cuda_only
def test_split_general_step_is_cuda_graph_capturable():
    """Capture the general launch with S chosen from a max_seq_len hint, replay it on other prefix
    lengths (longer and shorter) and tables: the split ranges follow the lengths on the device."""
    first = Step([(3000, 100), (10, 28)], **QWEN3, dtype=torch.bfloat16, seed=1)
    second = Step([(7000, 100), (400, 28)], **QWEN3, dtype=torch.bfloat16, seed=2)
    hint = 8192
    num_splits = paged_attention_module.choose_general_splits(128, 2, 32, 8, hint, DEVICE)
    assert num_splits > 1
    k_cache, v_cache = second.k_cache.clone(), second.v_cache.clone()
    tables = second.meta.block_tables.clone()
    tables[:, : first.meta.block_tables.shape[1]] = first.meta.block_tables.clamp_max(k_cache.shape[0] - 1)
    lens, qsl = first.meta.seq_lens.clone(), first.meta.query_start_loc.clone()
    query = first.query.clone()
    out = torch.empty_like(query)

    def attend():
        paged_attention(query, k_cache, v_cache, qsl, lens, tables, second.scale, 100, hint, out=out)

    attend()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend()
    second.append()
    for dst, src in ((query, second.query), (lens, second.meta.seq_lens), (tables, second.meta.block_tables),
                     (k_cache, second.k_cache), (v_cache, second.v_cache)):
        dst.copy_(src)
    graph.replay()
    second.check(out)
