"""Fused Triton kernels of the decoder layer and the sampler against their torch references.

On CPU the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1 before
Triton is imported) on tiny shapes; on CUDA the same checks run at real sizes, in bf16 too.
The models' CPU path is the torch code; here it is compared with the same models forced
onto the Triton path (`fused_kernels(True)`), and with Hugging Face for an odd vocabulary.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from roseray.layers.attention import attention_metadata
from roseray.layers.fused import fused_kernels
from roseray.layers.rotary import RotaryEmbedding
from roseray.layers.vocab import padded_vocab_size, vocab_logits, vocab_parameter
from roseray.models.loader import load_model, load_model_config
from roseray_kernels.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from roseray_kernels.fused_norm import layernorm, layernorm_reference, rmsnorm, rmsnorm_reference
from roseray_kernels.rotary import rotary_qk_, rotary_qk_reference
from roseray_kernels.sampling import gumbel_max_sample, split_columns
from tests.kernels.helpers import rel_err
from tests.models.helpers import step_metadata

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
SCALE = 16 if ON_CUDA else 1  # real sizes on a GPU, tiny ones in the interpreter
DTYPES = [torch.float32, torch.bfloat16] if ON_CUDA else [torch.float32]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


# --- RMSNorm (+ residual) ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 64])
def test_rmsnorm_matches_reference_with_and_without_residual(dtype, hidden):
    rows = 5 * SCALE
    x, residual, weight = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype, seed=1), \
        randn(hidden, dtype=dtype, seed=2)
    assert rel_err(rmsnorm(x, weight, 1e-6), rmsnorm_reference(x, weight, 1e-6)) < TOLERANCE[dtype]
    out, new_residual = rmsnorm(x, weight, 1e-6, residual)
    want_out, want_residual = rmsnorm_reference(x, weight, 1e-6, residual)
    assert out.dtype == dtype and new_residual.dtype == dtype
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)  # one rounding, like torch's add
    assert rel_err(out, want_out) < TOLERANCE[dtype]
    assert not torch.equal(new_residual, residual)  # the inputs are left alone


def test_rmsnorm_of_per_head_rows_of_a_strided_view():
    """Qwen3's q/k norm: [tokens, heads, head_dim] rows of a view of the qkv projection."""
    tokens, heads, head_dim = 3 * SCALE, 4, 16
    qkv = randn(tokens, (heads + 2) * head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    weight = randn(head_dim, seed=3)
    got = rmsnorm(q, weight, 1e-6)
    assert got.shape == q.shape
    assert rel_err(got, rmsnorm_reference(q, weight, 1e-6)) < 1e-5


# --- LayerNorm (+ residual) --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 64])
def test_layernorm_matches_reference_with_and_without_residual(dtype, hidden):
    rows = 5 * SCALE
    x, residual = randn(rows, hidden, dtype=dtype) + 3.0, randn(rows, hidden, dtype=dtype, seed=1)  # mean far from 0
    weight, bias = randn(hidden, dtype=dtype, seed=2), randn(hidden, dtype=dtype, seed=3)
    assert rel_err(layernorm(x, weight, bias, 1e-5), layernorm_reference(x, weight, bias, 1e-5)) < TOLERANCE[dtype]
    out, new_residual = layernorm(x, weight, bias, 1e-5, residual)
    want_out, want_residual = layernorm_reference(x, weight, bias, 1e-5, residual)
    assert out.dtype == dtype and new_residual.dtype == dtype
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)  # one rounding, like torch's add
    assert rel_err(out, want_out) < TOLERANCE[dtype]
    assert not torch.equal(new_residual, residual)  # the inputs are left alone


def test_layernorm_of_a_row_strided_view_and_a_constant_row():
    """Rows of a wider tensor (a view); a constant row normalises to the bias (variance 0 + eps)."""
    tokens, hidden = 4 * SCALE, 40
    wide = randn(tokens, hidden + 24)
    x = wide[:, :hidden]
    x[0] = 2.5
    weight, bias = randn(hidden, seed=4), randn(hidden, seed=5)
    got = layernorm(x, weight, bias, 1e-5)
    assert got.shape == x.shape and got.is_contiguous()
    assert rel_err(got, layernorm_reference(x, weight, bias, 1e-5)) < 1e-5
    torch.testing.assert_close(got[0], bias, atol=1e-4, rtol=0)  # the mean's fp32 rounding, over rstd ~ 316


# --- SiLU and mul ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    tokens, inter = 7 * SCALE, 40 * SCALE
    gate_up = randn(tokens, 2 * inter + 8, dtype=dtype)[:, : 2 * inter]  # a row-strided view
    got = silu_and_mul(gate_up)
    assert got.shape == (tokens, inter) and got.dtype == dtype
    assert rel_err(got, silu_and_mul_reference(gate_up)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_reference(dtype):
    tokens, inter = 7 * SCALE, 40 * SCALE
    gate_up = randn(tokens, 2 * inter + 8, dtype=dtype)[:, : 2 * inter] * 4  # a row-strided view; tanh saturates
    got = gelu_tanh_and_mul(gate_up)
    assert got.shape == (tokens, inter) and got.dtype == dtype
    assert rel_err(got, gelu_tanh_and_mul_reference(gate_up)) < TOLERANCE[dtype]


# --- RoPE (+ q/k norm), in place --------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 256])  # 256: Gemma's heads (8 warps: (4 + 2) x 256 > 4096 elements)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_qk_in_place_matches_reference(qk_norm, dtype, head_dim):
    tokens, heads, kv_heads = 6 * SCALE, 4, 2
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cache = RotaryEmbedding(head_dim, 128, 10000.0).cos_sin_cache.to(DEVICE)
    positions = torch.randint(0, 128, (tokens,), generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.int32)
    weights = (randn(head_dim, dtype=dtype, seed=5), randn(head_dim, dtype=dtype, seed=6)) if qk_norm else (None, None)
    want_q, want_k = rotary_qk_reference(q, k, positions, cache, *weights)
    rotary_qk_(q, k, positions, cache, *weights)
    assert rel_err(q, want_q) < TOLERANCE[dtype] and rel_err(k, want_k) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_rotary_at_position_zero_is_the_identity():
    q, k = randn(2, 4, 16), randn(2, 2, 16, seed=1)
    q0, k0 = q.clone(), k.clone()
    cos_sin = RotaryEmbedding(16, 8, 1e4).cos_sin_cache.to(DEVICE)
    rotary_qk_(q, k, torch.zeros(2, dtype=torch.int64, device=DEVICE), cos_sin)
    torch.testing.assert_close(q, q0, atol=0, rtol=0)
    torch.testing.assert_close(k, k0, atol=0, rtol=0)


# --- Gumbel-max sampling ------------------------------------------------------------------


def seed_tensor(seed: int) -> torch.Tensor:
    return torch.tensor([seed], dtype=torch.int64, device=DEVICE)


def test_gumbel_max_temperature_zero_rows_are_argmax_first_index_on_ties():
    logits = randn(6, 300 * SCALE)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1.0  # a tie: argmax takes the first
    logits[4, -1] = logits[4].max() + 1.0  # the last column of a ragged final block
    temperatures = torch.tensor([0.0, 0.0, 0.8, 0.0, 0.0, 1.5], device=DEVICE)
    for block in (16, 64):  # several blocks and splits per row
        token_ids = gumbel_max_sample(logits, temperatures, seed_tensor(3), block=block)
        argmax = logits.argmax(dim=-1)
        assert token_ids[[0, 1, 3, 4]].tolist() == argmax[[0, 1, 3, 4]].tolist()
        assert token_ids[1] == 7 and token_ids[4] == logits.shape[1] - 1


def test_gumbel_max_tokens_are_valid_and_depend_only_on_the_seed():
    logits = randn(5, 333)
    logits[:, 100:] = float("-inf")  # masked columns are never drawn
    temperatures = torch.full((5,), 2.0, device=DEVICE)
    draws = [gumbel_max_sample(logits, temperatures, seed_tensor(s), block=64, rows_per_program=r)
             for s, r in ((1, 1), (1, 4), (2, 4))]
    assert all(0 <= t < 100 for d in draws for t in d.tolist())
    assert torch.equal(draws[0], draws[1])  # the tiling does not change the noise
    many = torch.stack([gumbel_max_sample(logits, temperatures, seed_tensor(s)) for s in range(8)])
    assert len(set(many.flatten().tolist())) > 10  # different seeds, different draws


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_gumbel_max_follows_softmax_of_logits_over_temperature(temperature):
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.05, 0.02])
    num_draws = 6000
    logits = (probs.log() + 0.3).expand(num_draws, -1).contiguous().to(DEVICE)
    token_ids = gumbel_max_sample(logits, torch.full((num_draws,), temperature, device=DEVICE), seed_tensor(11))
    counts = Counter(token_ids.tolist())
    expected = torch.softmax(probs.log() / temperature, dim=0) * num_draws
    chi_square = sum((counts[v] - e) ** 2 / e for v, e in enumerate(expected.tolist()))
    # 6 degrees of freedom: P(chi2 > 22.5) = 0.001
    assert chi_square < 22.5, (chi_square, counts, expected)
    assert set(counts) <= set(range(len(probs)))


def test_split_columns_fill_the_gpu_and_cover_the_row():
    for rows, vocab in ((1, 151936), (256, 151936), (128, 50257), (3, 10)):
        cols = split_columns(rows, vocab)
        splits = math.ceil(vocab / cols)
        assert cols % 2048 == 0 and splits * cols >= vocab and (splits - 1) * cols < vocab
    assert math.ceil(151936 / split_columns(1, 151936)) >= 64  # one row still spreads over the SMs


# --- lm_head over padded vocab rows ------------------------------------------------------


def test_vocab_parameter_is_a_view_of_padded_zero_rows_and_logits_match():
    weight = vocab_parameter(317, 24)
    assert weight.shape == (317, 24) and padded_vocab_size(317) == 320
    assert weight.untyped_storage().nbytes() == 320 * 24 * weight.element_size()
    weight.data.normal_()
    padded = weight.as_strided((320, 24), (24, 1))
    assert torch.equal(padded[317:], torch.zeros(3, 24))
    hidden = torch.randn(5, 24)
    logits = vocab_logits(hidden, weight)
    assert logits.shape == (5, 317)
    torch.testing.assert_close(logits, hidden @ weight.T)
    plain = torch.randn(317, 24)  # an ordinary tensor: no padding to use, the same answer
    torch.testing.assert_close(vocab_logits(hidden, plain), hidden @ plain.T)


@pytest.mark.parametrize("tie", [True, False])
def test_llama_lm_head_shares_padded_storage_with_tied_embeddings(tie):
    config = load_model_config("random:tiny")
    config.vocab_size, config.tie_word_embeddings = 509, tie
    model = load_model(config, "random:tiny", "cpu", torch.float32)
    weight, embedding = model.lm_head.weight, model.model.embed_tokens.weight
    assert weight.shape == embedding.shape == (509, config.hidden_size)
    assert (weight is embedding) == tie and weight.untyped_storage().nbytes() >= 512 * config.hidden_size * 4
    names = [name for name, _ in model.named_parameters()]
    assert ("lm_head.weight" in names) == (not tie)


# --- whole models: the Triton path equals the torch path -------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2", "gemma2", "gemma3", "phi3"])
def test_model_logits_on_the_triton_path_equal_the_torch_path(kind, tiny_checkpoint):
    path = tiny_checkpoint(kind)
    config = load_model_config(str(path))
    model = load_model(config, str(path), DEVICE, torch.float32)
    prompt = torch.randint(1, config.vocab_size, (9,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    meta = step_metadata([([0] * 3, 0, 9)])
    meta.slot_mapping.fill_(-1)  # a forward without a KV cache
    meta = type(meta)(**{name: (value.to(DEVICE) if isinstance(value, torch.Tensor) else value)
                         for name, value in vars(meta).items()})
    positions = torch.arange(9, device=DEVICE)
    with torch.no_grad(), attention_metadata(meta):
        with fused_kernels(True):
            fused_logits = model.compute_logits(model(prompt, positions))
        with fused_kernels(False):
            torch_logits = model.compute_logits(model(prompt, positions))
    assert torch.isfinite(fused_logits).all()
    assert rel_err(fused_logits, torch_logits) < 1e-5
