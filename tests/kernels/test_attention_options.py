"""Paged attention's layer options (sliding window, logit softcap, attention sinks) and head_dim 256
against the torch reference (`paged_attention_reference`).

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on tiny
shapes with small cache blocks, so windows fall inside one block, span several, or exceed the
sequence. On CUDA: bf16 at gpt-oss's and Gemma's attention geometry with contexts up to 4k, and a
CUDA graph of a decode step with the options replayed on new lengths and tables.

Blocks wholly outside every query's window are set to NaN after the reference is taken: a kernel
that read one would put NaN in its output.
"""

from __future__ import annotations

import random

import pytest
import torch

from roseray.layers.attention import TorchAttentionBackend, paged_attention_reference
from roseray.layers.triton_backend import TritonAttentionBackend
from roseray_kernels.kv_append import kv_append, kv_append_reference
from roseray_kernels.paged_attention import KernelConfig, paged_attention
from tests.kernels.helpers import rel_err
from tests.kernels.test_kernels import (
    DEVICE,
    NEEDS_FRESH_PROCESS,
    ON_CUDA,
    TOLERANCE,
    Step,
    decode_seqs,
    paged_attention_module,
)

pytestmark = pytest.mark.skipif(NEEDS_FRESH_PROCESS, reason="Triton was imported before TRITON_INTERPRET=1 was set")

# Option sets: window inside one block (blocks of 8 here), window over several blocks, window longer
# than any sequence, a softcap that bends N(0, 1) scores, sinks, and everything together.
OPTION_SETS = {
    "window-3": dict(sliding_window=3),
    "window-20": dict(sliding_window=20),
    "window-1000": dict(sliding_window=1000),
    "softcap": dict(softcap=1.0),
    "sinks": dict(sinks=True),
    "all": dict(sliding_window=20, softcap=1.0, sinks=True),
}


def options_for(step: Step, options: dict, seed: int = 0) -> dict:
    """`options` with sinks=True replaced by random per-head logits (about the size of the scores)."""
    options = dict(options)
    if options.get("sinks") is True:
        gen = torch.Generator().manual_seed(100 + seed)
        options["sinks"] = (2 * torch.randn(step.query.shape[1], generator=gen)).to(DEVICE)
    return options


def poison_outside_window(step: Step, window: int | None) -> int:
    """NaN into the K/V of every block that lies wholly before the window of its sequence's first
    query (no query of the step may read it); returns how many blocks were poisoned."""
    if window is None:
        return 0
    poisoned = 0
    tables = step.meta.block_tables.cpu()
    for i, (ctx, _) in enumerate(step.seqs):
        first_key = max(ctx - window + 1, 0)
        for b in range(first_key // step.block_size):
            block = int(tables[i, b])
            step.k_cache[block] = float("nan")
            step.v_cache[block] = float("nan")
            poisoned += 1
    return poisoned


def run_and_check(step: Step, options: dict, num_splits: int | None = None) -> int:
    """Append, take the reference, poison blocks outside the windows, attend and compare.
    Returns the number of poisoned blocks."""
    step.append()
    ref = paged_attention_reference(step.query.float(), step.k_cache, step.v_cache, step.meta, step.scale, **options)
    poisoned = poison_outside_window(step, options.get("sliding_window"))
    out = step.attend(num_splits=num_splits, **options)
    assert not out.isnan().any(), "NaN in the output (unwritten row or a read of a block outside the window)"
    err = rel_err(out[: step.num_real].float(), ref[: step.num_real])
    assert err < TOLERANCE[step.dtype], f"relative error {err:.2e}"
    assert (out[step.num_real:] == 0).all(), "padding rows must be zero"
    return poisoned


@pytest.fixture
def small_tiles(monkeypatch):
    """Prefill tiles of 16 rows and 16 keys: a prompt spans several query tiles, each with its own window start."""
    monkeypatch.setattr(paged_attention_module, "PREFILL_CONFIG", KernelConfig(16, num_warps=4, num_stages=1,
                                                                                block_m=16))


# ---------------------------------------------------------------------------------------
# Interpreter (and CUDA at the same sizes): each option alone and together
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("group", [1, 4])
def test_decode_with_options(group, name):
    """Group 1 runs the dot-free decode, group 4 the tl.dot one."""
    step = Step(decode_seqs([1, 7, 8, 9, 30, 41]), num_kv_heads=2, group=group, head_dim=32, dtype=torch.float32,
                block_size=8, pad_tokens=1, seed=group)
    poisoned = run_and_check(step, options_for(step, OPTION_SETS[name], group))
    if name in ("window-3", "window-20"):
        assert poisoned > 0, "the step must have blocks outside the window"


@pytest.mark.parametrize("name", ["window-20", "sinks", "all"])
@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize("group", [1, 2])
def test_decode_split_kv_with_options(group, num_splits, name):
    """Splits share the window's blocks; the sink is counted once, in the combine; a padded
    sequence (seq_len 0, no query row) is skipped."""
    seqs = decode_seqs([40, 3, 16, 70]) + [(0, 0)]
    step = Step(seqs, num_kv_heads=2, group=group, head_dim=32, dtype=torch.float32, block_size=8, pad_tokens=2,
                seed=num_splits)
    step.meta.seq_lens[-1] = 0
    run_and_check(step, options_for(step, OPTION_SETS[name]), num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_graph_padding_rows_with_sinks_are_zero(num_splits):
    """CUDA-graph padding rows (seq_len 0, one query row each) give zeros, sink or not."""
    step = Step(decode_seqs([5, 16, 33]) + [(0, 1), (0, 1)], num_kv_heads=2, group=2, head_dim=32,
                dtype=torch.float32, block_size=8)
    step.meta.seq_lens[-2:] = 0
    step.slot_mapping[-2:] = -1
    step.num_real = 3
    run_and_check(step, options_for(step, OPTION_SETS["all"]), num_splits=num_splits)


PREFILL_SEQS = [(20, 13), (0, 9), (31, 1), (16, 1), (5, 17), (0, 40)]  # prefix chunks, fresh prompts, decodes


@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_with_prefix_and_mixed_batch_with_options(group, name, small_tiles):
    step = Step(PREFILL_SEQS, num_kv_heads=2, group=group, head_dim=32, dtype=torch.float32, block_size=8,
                pad_tokens=3, seed=10 + group)
    poisoned = run_and_check(step, options_for(step, OPTION_SETS[name], group))
    if name in ("window-3", "window-20"):
        assert poisoned > 0


def test_prefill_default_tiles_with_options():
    """The shipped prefill tile shape (one tile per chunk here) with every option."""
    step = Step(PREFILL_SEQS, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32, block_size=8, seed=4)
    run_and_check(step, options_for(step, OPTION_SETS["all"]))


@pytest.mark.parametrize("window", [1, 8, 9])
def test_window_edges(window, small_tiles):
    """A window of one key (the query itself), exactly one block, one key past a block."""
    seqs = [(17, 1), (8, 1), (0, 20), (9, 7)]
    step = Step(seqs, num_kv_heads=1, group=2, head_dim=32, dtype=torch.float32, block_size=8, seed=window)
    run_and_check(step, dict(sliding_window=window))


@pytest.mark.parametrize("seqs", [decode_seqs([3, 17, 30]), [(9, 7), (0, 12), (20, 1)]], ids=["decode", "mixed"])
def test_head_dim_256_with_options(seqs):
    step = Step(seqs, num_kv_heads=2, group=2, head_dim=256, dtype=torch.float32, block_size=8, pad_tokens=1)
    run_and_check(step, options_for(step, dict(sliding_window=10, softcap=2.0, sinks=True)))


def test_head_dim_256_plain():
    step = Step([(9, 7), (25, 1)], num_kv_heads=1, group=1, head_dim=256, dtype=torch.float32, block_size=8)
    run_and_check(step, {})


def test_kv_append_head_dim_256():
    step = Step([(7, 1), (0, 10)], num_kv_heads=2, group=1, head_dim=256, dtype=torch.float32, pad_tokens=1)
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    kv_append_reference(step.key, step.value, k_ref, v_ref, step.slot_mapping)
    kv_append(step.key, step.value, step.k_cache, step.v_cache, step.slot_mapping)
    assert torch.equal(step.k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(step.v_cache.view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("seqs", [decode_seqs([5, 30]), [(9, 12), (20, 1)]], ids=["decode", "mixed"])
def test_triton_backend_passes_options(seqs):
    step = Step(seqs, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32, block_size=8, seed=3)
    step.append()
    options = options_for(step, OPTION_SETS["all"])
    out = TritonAttentionBackend().forward(step.query, step.k_cache, step.v_cache, step.meta, step.scale, **options)
    ref = TorchAttentionBackend().forward(step.query, step.k_cache, step.v_cache, step.meta, step.scale, **options)
    plain = TorchAttentionBackend().forward(step.query, step.k_cache, step.v_cache, step.meta, step.scale)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(plain, ref) > 1e-2  # the options change the result: the comparison above can fail


# ---------------------------------------------------------------------------------------
# CUDA only: bf16 at real sizes (gpt-oss: 64 q / 8 kv heads of 64, sinks, window 128;
# Gemma: 16 q / 8 kv heads of 256, softcap 50, window 1024), contexts up to 4k
# ---------------------------------------------------------------------------------------
GPT_OSS = dict(num_kv_heads=8, group=8, head_dim=64, options=dict(sliding_window=128, sinks=True))
GEMMA = dict(num_kv_heads=8, group=2, head_dim=256, options=dict(sliding_window=1024, softcap=50.0))
MODELS = {"gpt-oss": GPT_OSS, "gemma": GEMMA}
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a GPU")


def real_step(model: dict, seqs, seed: int) -> Step:
    return Step(seqs, model["num_kv_heads"], model["group"], model["head_dim"], torch.bfloat16, pad_tokens=2,
                seed=seed)


@cuda_only
@pytest.mark.parametrize("model", list(MODELS))
def test_real_size_decode(model):
    rng = random.Random(1)
    step = real_step(MODELS[model], decode_seqs([rng.randint(1, 4096) for _ in range(48)] + [4096, 1000, 129]), 1)
    assert run_and_check(step, options_for(step, MODELS[model]["options"])) > 0


@cuda_only
@pytest.mark.parametrize("num_splits", [None, 16])
@pytest.mark.parametrize("model", list(MODELS))
def test_real_size_decode_split_kv(model, num_splits):
    """Few long sequences: split-KV over the window's blocks (None: the launcher's own choice)."""
    step = real_step(MODELS[model], decode_seqs([4096, 3000, 1500]), 2)
    run_and_check(step, options_for(step, MODELS[model]["options"]), num_splits=num_splits)


@cuda_only
@pytest.mark.parametrize("model", list(MODELS))
def test_real_size_prefill_with_prefix(model):
    # query chunks of <= 512 rows: the reference holds [seqs, heads, max_query_len, max_seq_len] fp32 scores
    seqs = [(3584, 512), (0, 512), (1023, 1), (2000, 257), (4000, 1), (100, 400)]
    step = real_step(MODELS[model], seqs, 3)
    assert run_and_check(step, options_for(step, MODELS[model]["options"])) > 0


@cuda_only
@pytest.mark.parametrize("model", list(MODELS))
def test_decode_step_with_options_is_cuda_graph_capturable(model):
    """Capture kv_append + attention of a decode step (the launcher choosing split-KV from the model's
    max length, as the runner's capture does) and replay it on another step's lengths and tables."""
    cfg, rng = MODELS[model], random.Random(0)
    first = real_step(cfg, decode_seqs([rng.randint(1, 2000) for _ in range(4)]), 1)
    second = real_step(cfg, decode_seqs([rng.randint(2000, 4096) for _ in range(4)]), 2)
    options = options_for(second, cfg["options"])
    k_cache, v_cache = second.k_cache.clone(), second.v_cache.clone()
    tables = second.meta.block_tables.clone()
    tables[:, : first.meta.block_tables.shape[1]] = first.meta.block_tables.clamp_max(k_cache.shape[0] - 1)
    lens, qsl = first.meta.seq_lens.clone(), first.meta.query_start_loc.clone()
    query, key, value, slots = first.query.clone(), first.key.clone(), first.value.clone(), first.slot_mapping.clone()
    slots.clamp_(max=k_cache.shape[0] * 16 - 1)
    out = torch.empty_like(query)

    def step():
        kv_append(key, value, k_cache, v_cache, slots)
        paged_attention(query, k_cache, v_cache, qsl, lens, tables, second.scale, 1, 4096, out=out, **options)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for dst, src in ((query, second.query), (key, second.key), (value, second.value), (slots, second.slot_mapping),
                     (lens, second.meta.seq_lens), (tables, second.meta.block_tables)):
        dst.copy_(src)
    k_cache.copy_(second.k_cache)
    v_cache.copy_(second.v_cache)
    graph.replay()
    second.append()
    ref = paged_attention_reference(second.query.float(), second.k_cache, second.v_cache, second.meta, second.scale,
                                    **options)
    assert rel_err(out[: second.num_real].float(), ref[: second.num_real]) < TOLERANCE[torch.bfloat16]
