"""The fp8 (e4m3) KV cache in the kernels: kv_append quantizes bit for bit like torch's clamp + cast,
and every paged-attention launch (decode, dot-free MHA decode, split-KV decode, prefill over a cached
prefix) reading an fp8 cache with non-unit scales matches the torch reference on the dequantized cache.

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1): fp8
loads and the conversion to the query's dtype run there; the interpreter's own fp32 -> fp8 cast does
not round to nearest, which is why kv_append rounds in fp32 before its cast (exact on every backend).
On CUDA the same checks run in bf16, plus head_dim 256 and a CUDA graph of an fp8 decode step.
"""

from __future__ import annotations

import random

import pytest
import torch

from roseray.layers.attention import TorchAttentionBackend, paged_attention_reference
from roseray.layers.kv_fp8 import FP8_KV_DTYPE, dequantize_fp8, quantize_fp8
from roseray.layers.triton_backend import TritonAttentionBackend
from roseray_kernels.kv_append import kv_append, kv_append_reference, quantize_fp8_reference
from roseray_kernels.paged_attention import paged_attention
from tests.kernels.helpers import rel_err
from tests.kernels.test_attention_options import OPTION_SETS, options_for
from tests.kernels.test_kernels import DEVICE, NEEDS_FRESH_PROCESS, ON_CUDA, TOLERANCE, Step, decode_seqs

pytestmark = pytest.mark.skipif(NEEDS_FRESH_PROCESS, reason="Triton was imported before TRITON_INTERPRET=1 was set")
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")

DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
K_SCALE, V_SCALE = 0.05, 0.3  # cache values well inside e4m3's range, and results that differ from scale 1
NAN_E4M3 = 0x7F


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fp8_step(seqs, group: int, head_dim: int = 64, block_size: int = 16, pad_tokens: int = 0, seed: int = 0,
             dtype: torch.dtype = DTYPE) -> Step:
    """A Step whose cache is e4m3: the random values quantized with K_SCALE / V_SCALE (NaN blocks stay NaN)."""
    step = Step(seqs, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, block_size=block_size,
                pad_tokens=pad_tokens, seed=seed)
    step.k_cache, step.v_cache = quantize_fp8(step.k_cache, K_SCALE), quantize_fp8(step.v_cache, V_SCALE)
    return step


def append_and_reference(step: Step, options: dict) -> torch.Tensor:
    """kv_append into the fp8 cache, then the reference on the dequantized cache (fp32, no scales)."""
    kv_append(step.key, step.value, step.k_cache, step.v_cache, step.slot_mapping, K_SCALE, V_SCALE)
    k, v = dequantize_fp8(step.k_cache, K_SCALE), dequantize_fp8(step.v_cache, V_SCALE)
    return paged_attention_reference(step.query.float(), k, v, step.meta, step.scale, **options)


def poison_outside_window_fp8(step: Step, window: int | None) -> None:
    """e4m3 NaN into every block wholly before its sequence's window (no query may read it)."""
    if window is None:
        return
    tables = step.meta.block_tables.cpu()
    for i, (ctx, _) in enumerate(step.seqs):
        for b in range(max(ctx - window + 1, 0) // step.block_size):
            step.k_cache.view(torch.uint8)[int(tables[i, b])] = NAN_E4M3
            step.v_cache.view(torch.uint8)[int(tables[i, b])] = NAN_E4M3


def check(step: Step, ref: torch.Tensor, options: dict, num_splits: int | None = None) -> None:
    poison_outside_window_fp8(step, options.get("sliding_window"))
    out = step.attend(num_splits=num_splits, **options, k_scale=K_SCALE, v_scale=V_SCALE)
    assert not out.isnan().any(), "NaN in the output (unwritten row or a read of unowned cache)"
    err = rel_err(out[: step.num_real].float(), ref[: step.num_real])
    assert err < TOLERANCE[step.dtype], f"relative error {err:.2e}"
    assert (out[step.num_real:] == 0).all(), "padding rows must be zero"


# ---------------------------------------------------------------------------------------
# KV append
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_kv_append_fp8_is_torch_clamp_and_cast_bit_for_bit(dtype, scale):
    """Values from e4m3's subnormals (and below) to far past 448, infinities, -0.0 and values that
    round up into the next binade; padding slots (-1) leave their rows alone."""
    seqs = [(15, 1), (0, 20), (31, 2), (7, 9)]
    step = Step(seqs, num_kv_heads=2, group=1, head_dim=64, dtype=torch.float32, pad_tokens=3)
    magnitudes = torch.logspace(-6, 4, step.key.shape[0] * 2 * 64).view(step.key.shape)
    key = step.key.cpu() * magnitudes
    key[0, 0, :6] = torch.tensor([float("inf"), -float("inf"), -0.0, 31.44 * scale, -31.97 * scale, 1e30])
    key, value = key.to(DEVICE, dtype), (step.value * 300).to(dtype)
    k_cache = quantize_fp8(step.k_cache, 1.0)
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    kv_append(key, value, k_cache, v_cache, step.slot_mapping, scale, 2 * scale)
    kv_append_reference(key, value, k_ref, v_ref, step.slot_mapping, scale, 2 * scale)
    assert same_bits(k_cache, k_ref) and same_bits(v_cache, v_ref)
    written = step.slot_mapping[step.slot_mapping >= 0]
    rows = k_cache.view(-1, 2, 64)[written]
    assert not rows.float().isnan().any(), "out-of-range values must saturate, not become NaN"
    assert rows.float().abs().max() == 448.0 and (rows.float() == 0).any()
    # the reference is torch's own cast of the scaled values
    want = (key.float() * torch.tensor(1 / scale)).clamp(-448, 448).to(FP8_KV_DTYPE)
    assert same_bits(rows, want[: len(written)])


def test_torch_backend_stores_the_same_fp8_bits_and_reads_them_back():
    step = fp8_step([(9, 4), (16, 1)], group=2, pad_tokens=2, seed=3)
    torch_k, torch_v = step.k_cache.clone(), step.v_cache.clone()
    TritonAttentionBackend().store_kv(step.key, step.value, step.k_cache, step.v_cache, step.slot_mapping, K_SCALE,
                                      V_SCALE)
    TorchAttentionBackend().store_kv(step.key, step.value, torch_k, torch_v, step.slot_mapping, K_SCALE, V_SCALE)
    assert same_bits(step.k_cache, torch_k) and same_bits(step.v_cache, torch_v)
    assert same_bits(quantize_fp8_reference(step.key, K_SCALE), quantize_fp8(step.key, K_SCALE))
    got = TorchAttentionBackend().forward(step.query, torch_k, torch_v, step.meta, step.scale, k_scale=K_SCALE,
                                          v_scale=V_SCALE)
    want = paged_attention_reference(step.query.float(), dequantize_fp8(torch_k, K_SCALE),
                                     dequantize_fp8(torch_v, V_SCALE), step.meta, step.scale)
    exact = step.query.dtype == torch.float32  # on a GPU the backend computes in bf16, the reference in fp32
    torch.testing.assert_close(got.float(), want, rtol=0 if exact else 2e-2, atol=0 if exact else 2e-2)
    unit = TorchAttentionBackend().forward(step.query, torch_k, torch_v, step.meta, step.scale)
    assert rel_err(unit.float(), want) > 0.1, "the scales must reach the reference"


# ---------------------------------------------------------------------------------------
# Paged attention reading an fp8 cache
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["plain", "all"])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_reads_fp8(group, name):
    """Group 1: the dot-free decode; group 4: tl.dot on converted tiles. "all": window, softcap, sinks."""
    step = fp8_step(decode_seqs([1, 7, 8, 9, 30, 41]), group=group, block_size=8, pad_tokens=1, seed=group)
    options = options_for(step, OPTION_SETS.get(name, {}), group)
    check(step, append_and_reference(step, options), options)


@pytest.mark.parametrize("name", ["plain", "sinks"])
def test_split_kv_decode_reads_fp8(name):
    """v_scale multiplies each split's accumulator; the combine (and the sink there) is unchanged."""
    seqs = decode_seqs([40, 3, 16, 70]) + [(0, 0)]
    step = fp8_step(seqs, group=2, pad_tokens=2, seed=4)
    step.meta.seq_lens[-1] = 0
    options = options_for(step, OPTION_SETS.get(name, {}))
    check(step, append_and_reference(step, options), options, num_splits=4)


@pytest.mark.parametrize("name", ["plain", "all"])
def test_prefill_with_cached_prefix_reads_fp8(name):
    """Chunks over a cached prefix, a fresh prompt, decodes and padding rows in one step."""
    seqs = [(20, 13), (0, 9), (31, 1), (5, 17), (48, 16)]
    step = fp8_step(seqs, group=2, block_size=8, pad_tokens=3, seed=11)
    options = options_for(step, OPTION_SETS.get(name, {}))
    check(step, append_and_reference(step, options), options)


def test_scales_are_ignored_by_a_cache_in_the_query_dtype():
    step = Step([(20, 3), (7, 1)], num_kv_heads=2, group=2, head_dim=64, dtype=DTYPE, seed=2)
    step.append()
    plain = step.attend()
    torch.testing.assert_close(step.attend(k_scale=3.0, v_scale=0.1), plain, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# CUDA: head_dim 256 and a captured decode step
# ---------------------------------------------------------------------------------------
@cuda_only
@pytest.mark.parametrize("group", [1, 2])
def test_head_dim_256_reads_fp8(group):
    seqs = [(300, 40), (0, 64), (999, 1), (2000, 1)]
    step = fp8_step(seqs, group=group, head_dim=256, pad_tokens=2, seed=group)
    options = options_for(step, {"sliding_window": 512, "softcap": 30.0})
    check(step, append_and_reference(step, options), options)


@cuda_only
def test_fp8_decode_step_is_cuda_graph_capturable():
    """kv_append + split-KV decode on an fp8 cache, captured, replayed on other lengths and tables."""
    rng = random.Random(0)
    first = fp8_step(decode_seqs([rng.randint(1, 2000) for _ in range(4)]), group=4, seed=1)
    second = fp8_step(decode_seqs([rng.randint(2000, 4096) for _ in range(4)]), group=4, seed=2)
    options = options_for(second, {"sliding_window": 1024, "sinks": True})
    k_cache, v_cache = second.k_cache.clone(), second.v_cache.clone()
    tables = second.meta.block_tables.clone()
    tables[:, : first.meta.block_tables.shape[1]] = first.meta.block_tables.clamp_max(k_cache.shape[0] - 1)
    lens, qsl = first.meta.seq_lens.clone(), first.meta.query_start_loc.clone()
    query, key, value, slots = first.query.clone(), first.key.clone(), first.value.clone(), first.slot_mapping.clone()
    slots.clamp_(max=k_cache.shape[0] * 16 - 1)
    out = torch.empty_like(query)

    def step():
        kv_append(key, value, k_cache, v_cache, slots, K_SCALE, V_SCALE)
        paged_attention(query, k_cache, v_cache, qsl, lens, tables, second.scale, 1, 4096, out=out, **options,
                        k_scale=K_SCALE, v_scale=V_SCALE)

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
    ref = append_and_reference(second, options)
    assert rel_err(out[: second.num_real].float(), ref[: second.num_real]) < TOLERANCE[torch.bfloat16]
