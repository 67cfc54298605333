"""Triton kernels (roseray_kernels) against their torch references.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
Triton is imported) on tiny shapes; on CUDA the same checks run at real sizes in bf16
too, plus CUDA-graph capture of a decode step.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`

import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="Triton is not installed")

# Triton's own library kernels (tl.sum, tl.max, tl.cdiv) are built when triton.language is
# first imported; the interpreter runs ours only if they were built for it too. In a full
# `pytest tests/` run, transformers -> torch._dynamo imports Triton before this module, so
# on CPU the checks then run in a fresh process (test_kernels_in_a_fresh_interpreter_process).
INTERPRETER_READY = type(triton.language.sum).__name__ == "InterpretedFunction"
NEEDS_FRESH_PROCESS = not ON_CUDA and not INTERPRETER_READY

import importlib  # noqa: E402

from roseray.layers.attention import AttentionMetadata, TorchAttentionBackend, paged_attention_reference  # noqa: E402
from roseray_kernels.kv_append import kv_append, kv_append_index_put_baseline, kv_append_reference  # noqa: E402
from roseray_kernels.paged_attention import KernelConfig, paged_attention  # noqa: E402
from tests.kernels.helpers import rel_err  # noqa: E402

# The module (the package exports its function under the same name): configs are patched on it.
paged_attention_module = importlib.import_module("roseray_kernels.paged_attention")


DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
# On CUDA real sizes; on the CPU interpreter, tiny ones.
SCALE_UP = 16 if ON_CUDA else 1
# more KV splits than the longest test sequence has tiles (so some splits are empty): the most the
# kernels take on CUDA; fewer under the interpreter, which runs every program of the grid one by one
MANY_SPLITS = 64 if ON_CUDA else 16
DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def _kernels_can_run(request):
    if NEEDS_FRESH_PROCESS and request.node.name != "test_kernels_in_a_fresh_interpreter_process":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set: covered by the fresh-process test")


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernels run in this process")
def test_kernels_in_a_fresh_interpreter_process():
    """Run this module again where TRITON_INTERPRET=1 precedes the first Triton import."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------------------------------
# A step: sequences (cached prefix, query_len) over a shuffled paged cache
# ---------------------------------------------------------------------------------------
class Step:
    """Builds a random step: block tables over shuffled block ids, a random cache whose
    unreferenced blocks hold NaN (a read of them would show), and this step's K/V."""

    def __init__(self, seqs, num_kv_heads, group, head_dim, dtype, block_size=16, pad_tokens=0, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.seqs, self.block_size, self.dtype = seqs, block_size, dtype
        seq_lens = [ctx + q for ctx, q in seqs]
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        max_blocks = max(blocks_per_seq + [1]) + 1  # one spare column of -1 padding
        num_blocks = sum(blocks_per_seq) + 4
        # Block 0 is finite junk nobody owns (the reference reads it for -1 entries); NaN elsewhere unowned.
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
        owned = []
        for i, n in enumerate(blocks_per_seq):
            row, ids = ids[:n], ids[n:]
            tables[i, :n] = torch.tensor(row, dtype=torch.int32)
            owned += row
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"))
        self.v_cache = torch.full(shape, float("nan"))
        for b in owned + [0]:
            self.k_cache[b] = torch.randn(shape[1:], generator=gen)
            self.v_cache[b] = torch.randn(shape[1:], generator=gen)

        query_lens = [q for _, q in seqs]
        num_real = sum(query_lens)
        num_tokens = num_real + pad_tokens
        num_heads = num_kv_heads * group
        self.query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
        qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen)  # K, V as views of a fused tensor
        self.key, self.value = qkv[:, 1], qkv[:, 2]
        slots = torch.full((num_tokens,), -1, dtype=torch.int64)
        t = 0
        for i, (ctx, q) in enumerate(seqs):
            for pos in range(ctx, ctx + q):
                slots[t] = tables[i, pos // block_size].long() * block_size + pos % block_size
                t += 1
        qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
        self.slot_mapping = slots
        self.meta = AttentionMetadata(
            slot_mapping=slots.to(DEVICE), query_start_loc=qsl.to(DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE), block_tables=tables.to(DEVICE),
            max_query_len=max(query_lens + [1]), max_seq_len=max(seq_lens + [1]), num_seqs=len(seqs),
            block_size=block_size)
        self.num_real = num_real
        self.scale = head_dim ** -0.5
        for name in ("k_cache", "v_cache", "query", "key", "value"):
            setattr(self, name, getattr(self, name).to(DEVICE, dtype))
        self.slot_mapping = self.slot_mapping.to(DEVICE)

    def append(self) -> None:
        kv_append(self.key, self.value, self.k_cache, self.v_cache, self.slot_mapping)

    def attend(self, **kwargs) -> torch.Tensor:
        m = self.meta
        out = torch.full_like(self.query, float("nan"))  # every row must be written
        return paged_attention(self.query, self.k_cache, self.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                               self.scale, m.max_query_len, m.max_seq_len, out=out, **kwargs)

    def reference(self) -> torch.Tensor:
        return paged_attention_reference(self.query.float(), self.k_cache, self.v_cache, self.meta, self.scale)

    def check(self, out: torch.Tensor) -> None:
        ref = self.reference()
        assert not out.isnan().any(), "NaN in the output (unwritten row or a read of unowned cache)"
        err = rel_err(out[: self.num_real].float(), ref[: self.num_real])
        assert err < TOLERANCE[self.dtype], f"relative error {err:.2e}"
        assert (out[self.num_real:] == 0).all(), "padding rows must be zero"


def decode_seqs(seq_lens):
    return [(n - 1, 1) for n in seq_lens]


# ---------------------------------------------------------------------------------------
# KV append
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_append_matches_reference_exactly(slot_dtype, dtype):
    """Every token (decode, prefill chunk, block rollover) lands in its slot; -1 is skipped."""
    seqs = [(15, 1), (16, 1), (0, 20 * SCALE_UP), (31, 2), (7, 9)]
    step = Step(seqs, num_kv_heads=3, group=1, head_dim=64, dtype=dtype, pad_tokens=3)
    step.slot_mapping = step.slot_mapping.to(slot_dtype)
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    kv_append_reference(step.key, step.value, k_ref, v_ref, step.slot_mapping)
    step.append()
    # NaN == NaN is False: compare bit patterns, so untouched poisoned blocks compare equal too.
    assert torch.equal(step.k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(step.v_cache.view(torch.uint8), v_ref.view(torch.uint8))


def test_kv_append_ignores_slots_past_num_tokens_and_baseline_agrees():
    """slot_mapping may be a longer preallocated buffer; only key.shape[0] entries count."""
    step = Step([(3, 5), (17, 1)], num_kv_heads=2, group=1, head_dim=64, dtype=torch.float32, pad_tokens=2)
    # slot 0 would clobber
    long_slots = torch.cat([step.slot_mapping, torch.zeros(5, dtype=torch.int64, device=DEVICE)])
    k_ref, v_ref = step.k_cache.clone(), step.v_cache.clone()
    kv_append_reference(step.key, step.value, k_ref, v_ref, step.slot_mapping)
    k_base, v_base = step.k_cache.clone(), step.v_cache.clone()
    kv_append_index_put_baseline(step.key, step.value, k_base, v_base, long_slots)
    kv_append(step.key, step.value, step.k_cache, step.v_cache, long_slots)
    for got in (step.k_cache, k_base):
        assert torch.equal(got.view(torch.uint8), k_ref.view(torch.uint8))
    for got in (step.v_cache, v_base):
        assert torch.equal(got.view(torch.uint8), v_ref.view(torch.uint8))


# ---------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_across_block_boundaries(group, head_dim, dtype):
    """The default configs: group 1 dot-free (DECODE_MHA_CONFIG), GQA groups on tl.dot."""
    lens = [1, 15, 16, 17, 32, 33 * SCALE_UP, 50 * SCALE_UP, 65, 129]
    step = Step(decode_seqs(lens), num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=group)
    step.append()
    step.check(step.attend())


@pytest.fixture
def mha_decode_block_n(monkeypatch):
    """Sets the dot-free MHA decode's tile of keys (16 makes a few loop steps of short contexts)."""
    def set_block_n(block_n: int) -> None:
        monkeypatch.setattr(paged_attention_module, "DECODE_MHA_CONFIG",
                            KernelConfig(block_n, num_warps=2, num_stages=1, use_dot=False))

    return set_block_n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_n", [16, 64])
def test_mha_decode_across_block_boundaries(block_n, head_dim, dtype, mha_decode_block_n):
    """Group of one (GPT-2): the dot-free kernel, over several tiles and block boundaries."""
    mha_decode_block_n(block_n)
    lens = [1, 15, 16, 17, 32, 33, 64, 65, 129, 50 * SCALE_UP]
    step = Step(decode_seqs(lens), num_kv_heads=3, group=1, head_dim=head_dim, dtype=dtype, seed=block_n,
                pad_tokens=2)
    step.append()
    step.check(step.attend())


@pytest.mark.parametrize("num_splits", [2, MANY_SPLITS])
def test_mha_decode_split_kv_with_graph_padding(num_splits, mha_decode_block_n):
    mha_decode_block_n(16)
    seqs = decode_seqs([40 * SCALE_UP, 3, 16, 70 * SCALE_UP]) + [(0, 0)]
    step = Step(seqs, num_kv_heads=3, group=1, head_dim=64, dtype=torch.float32, pad_tokens=2, seed=num_splits)
    step.meta.seq_lens[-1] = 0
    step.append()
    step.check(step.attend(num_splits=num_splits))


@pytest.mark.parametrize("seqs", [decode_seqs([1, 17, 40]), [(0, 9), (16, 1), (5, 12)]], ids=["decode", "mixed"])
def test_attention_takes_query_views_of_a_fused_qkv(seqs):
    """GPT-2 passes q as a view of its c_attn output (token stride 3 * hidden): same output."""
    step = Step(seqs, num_kv_heads=3, group=1, head_dim=64, dtype=torch.float32, seed=5)
    step.append()
    want = step.attend()
    qkv = torch.zeros(step.query.shape[0], 3, 3 * 64, device=DEVICE)
    qkv[:, 0] = step.query.reshape(step.query.shape[0], -1)
    step.query = qkv[:, 0].view(step.query.shape)
    assert step.query.stride(0) == 3 * 3 * 64
    torch.testing.assert_close(step.attend(), want, atol=0, rtol=0)


@pytest.mark.parametrize("num_splits", [2, 4, MANY_SPLITS])
def test_decode_split_kv_with_graph_padding(num_splits):
    """Flash-decoding splits, a padded sequence (seq_len 0, slot -1) and padding rows."""
    seqs = decode_seqs([40 * SCALE_UP, 3, 16, 70 * SCALE_UP]) + [(0, 0)]
    step = Step(seqs, num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32, pad_tokens=2, seed=num_splits)
    step.meta.seq_lens[-1] = 0
    step.append()
    step.check(step.attend(num_splits=num_splits))


def test_decode_graph_padding_rows_have_zero_length():
    """CUDA-graph padding: query_start_loc = arange, padded rows have seq_len 0 and slot -1."""
    step = Step(decode_seqs([5, 16, 33]) + [(0, 1), (0, 1)], num_kv_heads=2, group=2, head_dim=64,
                dtype=torch.float32)
    step.meta.seq_lens[-2:] = 0
    step.slot_mapping[-2:] = -1
    step.num_real = 3  # the reference gives zeros for rows of empty sequences
    step.append()
    step.check(step.attend())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_prefill_chunks_and_decode(group, dtype):
    """Prefill chunks over a cached prefix, a fresh prompt, decodes and padding rows together."""
    s = SCALE_UP
    seqs = [(20 * s, 13 * s), (0, 9 * s), (31, 1), (16, 1), (0, 1), (5, 17 * s), (48, 16)]
    step = Step(seqs, num_kv_heads=2, group=group, head_dim=64, dtype=dtype, pad_tokens=3, seed=10 + group)
    step.append()
    step.check(step.attend())


@pytest.mark.parametrize("block_size", [8, 16])
def test_head_dim_128(block_size):
    seqs = [(19, 6), (0, 17), (40, 1)]
    step = Step(seqs, num_kv_heads=1, group=2, head_dim=128, dtype=torch.float32, block_size=block_size, seed=7)
    step.append()
    step.check(step.attend())


def test_rejects_non_power_of_two_head_dim():
    q = torch.zeros(1, 2, 96, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 96, device=DEVICE)
    i32 = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="power of two"):
        paged_attention(q, cache, cache, i32, i32[:1], i32.view(1, 2), 1.0, 1, 1)


def test_triton_backend_matches_torch_backend():
    from roseray.layers.triton_backend import TritonAttentionBackend

    step = Step([(9, 4), (16, 1)], num_kv_heads=2, group=2, head_dim=64, dtype=torch.float32, seed=3)
    torch_k, torch_v = step.k_cache.clone(), step.v_cache.clone()
    backend, reference = TritonAttentionBackend(), TorchAttentionBackend()
    assert backend.name == "triton"
    backend.store_kv(step.key, step.value, step.k_cache, step.v_cache, step.meta.slot_mapping)
    reference.store_kv(step.key, step.value, torch_k, torch_v, step.meta.slot_mapping)
    assert torch.equal(step.k_cache.view(torch.uint8), torch_k.view(torch.uint8))
    out = backend.forward(step.query, step.k_cache, step.v_cache, step.meta, step.scale)
    ref = reference.forward(step.query, torch_k, torch_v, step.meta, step.scale)
    assert rel_err(out, ref) < 1e-5


# ---------------------------------------------------------------------------------------
# CUDA only: graph capture of a decode step, replayed on new lengths and tables
# ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a GPU")
def test_decode_step_is_cuda_graph_capturable():
    rng = random.Random(0)
    batch, max_model_len = 32, 4096
    first = Step(decode_seqs([rng.randint(1, 2000) for _ in range(batch)]), 8, 2, 128, torch.bfloat16, seed=1)
    second = Step(decode_seqs([rng.randint(1, 4000) for _ in range(batch)]), 8, 2, 128, torch.bfloat16, seed=2)
    # Static buffers sized for the second step (more blocks), captured with the first step's contents.
    k_cache, v_cache = second.k_cache.clone(), second.v_cache.clone()
    tables = second.meta.block_tables.clone()
    tables[:, : first.meta.block_tables.shape[1]] = first.meta.block_tables.clamp_max(k_cache.shape[0] - 1)
    lens, qsl = first.meta.seq_lens.clone(), first.meta.query_start_loc.clone()
    query, key, value, slots = first.query.clone(), first.key.clone(), first.value.clone(), first.slot_mapping.clone()
    slots.clamp_(max=k_cache.shape[0] * 16 - 1)
    out = torch.empty_like(query)

    def step():
        kv_append(key, value, k_cache, v_cache, slots)
        paged_attention(query, k_cache, v_cache, qsl, lens, tables, second.scale, 1, max_model_len, out=out)

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
    assert torch.equal(k_cache.view(torch.uint8), second.k_cache.view(torch.uint8))
    second.check(out)
