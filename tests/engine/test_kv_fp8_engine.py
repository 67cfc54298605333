"""The engine with `kv_cache_dtype: fp8` (fp32 tiny Llama / Qwen3 on CPU, the torch backend): the cache
really is e4m3, greedy tokens mostly agree with the fp32 cache's, chunked prefill, prefix caching and
preemption give the plain fp8 run's tokens, the CPU budget holds 4x the fp32 blocks (2x the bf16 ones),
and kv_cache_scale reaches every layer and changes what the cache holds."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from roseray import LLM, SamplingParams
from roseray.engine.kv_cache import choose_kv_cache_dtype, set_kv_cache_scales
from roseray.layers.attention import Attention, set_kv_scales
from roseray.layers.kv_fp8 import FP8_KV_DTYPE

KINDS = ["llama", "qwen3"]
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
# fp8's ~6% steps move these random models' near-tied logits: most tokens still agree (measured 0.83-0.93)
MIN_AGREEMENT = 0.7


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_llm(path, **engine_args) -> LLM:
    return LLM(str(path), device="cpu", dtype=engine_args.pop("dtype", "float32"), block_size=4, **engine_args)


def generate(llm: LLM, batch):
    outputs = [o.outputs[0] for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    llm.engine.check_integrity()
    return outputs


def agreement(got, want) -> float:
    """Tokens up to each sequence's first difference, over all tokens (later ones are not comparable)."""
    matched = [next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), MAX_NEW)
               for g, w in zip(got, want)]
    return sum(matched) / (MAX_NEW * len(want))


def first_logprob_error(got, want) -> float:
    return max(abs(lp - w.logprobs[0][t]) for g, w in zip(got, want) for t, lp in g.logprobs[0].items()
               if t in w.logprobs[0])


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tiny_checkpoint):
    return request.param, tiny_checkpoint(request.param)


def test_fp8_cache_agrees_with_the_fp32_cache(checkpoint, caplog):
    _, path = checkpoint
    batch = prompts(8, 10, 40, seed=1)
    reference = generate(make_llm(path), batch)
    with caplog.at_level(logging.INFO, logger="roseray.engine.engine"):
        llm = make_llm(path, kv_cache_dtype="fp8")
    assert "fp8 e4m3" in next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert llm.engine.runner.kv_cache.dtype == FP8_KV_DTYPE
    assert all(layer.k_cache.dtype == FP8_KV_DTYPE for layer in llm.engine.runner.attention_layers)
    got = generate(llm, batch)
    assert agreement(got, reference) >= MIN_AGREEMENT
    error = first_logprob_error(got, reference)
    assert 0 < error < 0.1, error  # quantized (not the fp32 cache), and close


def test_chunked_prefill_prefix_caching_and_preemption_give_the_plain_fp8_tokens(checkpoint):
    """Every key and value is read back from the cache, so the way a prompt reached it does not matter."""
    _, path = checkpoint
    batch = prompts(6, 10, 24, seed=5)
    shared = prompts(1, 13, 13, seed=3)[0]
    prefixed = [shared + tail for tail in prompts(4, 1, 6, seed=4)]
    plain = make_llm(path, kv_cache_dtype="fp8", enable_prefix_caching=False)
    want, want_prefixed = generate(plain, batch), generate(plain, prefixed)

    chunked = generate(make_llm(path, kv_cache_dtype="fp8", max_num_batched_tokens=7, max_num_seqs=4), batch)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in want]

    llm = make_llm(path, kv_cache_dtype="fp8", enable_prefix_caching=True)
    got = generate(llm, prefixed[:1]) + generate(llm, prefixed[1:])
    assert llm.engine.get_stats().prefix_cache_hits >= 3 * 12
    assert [o.token_ids for o in got] == [o.token_ids for o in want_prefixed]

    # 16 blocks of 4 tokens: up to 10 blocks a request, six of them cannot run together
    llm = make_llm(path, kv_cache_dtype="fp8", num_kv_blocks=16, max_num_seqs=6, enable_prefix_caching=False)
    got = generate(llm, batch)
    assert llm.engine.get_stats().num_preemptions_total > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize(("dtype", "factor"), [("float32", 4), ("bfloat16", 2)])
def test_cpu_budget_holds_more_fp8_blocks(tiny_checkpoint, dtype, factor):
    path = tiny_checkpoint("llama")
    probe = make_llm(path, dtype=dtype, num_kv_blocks=1)
    gib = 64 * probe.engine.runner.bytes_per_block / 2**30  # 64 blocks in the model's dtype
    auto = make_llm(path, dtype=dtype, cpu_kv_cache_gib=gib)
    fp8 = make_llm(path, dtype=dtype, cpu_kv_cache_gib=gib, kv_cache_dtype="fp8")
    assert auto.engine.runner.num_blocks == 64
    assert fp8.engine.runner.num_blocks == 64 * factor
    assert fp8.engine.runner.bytes_per_block * factor == auto.engine.runner.bytes_per_block
    assert fp8.engine.runner.kv_cache.nbytes == auto.engine.runner.kv_cache.nbytes


def test_kv_cache_scale_reaches_every_layer_and_the_cache(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    batch = prompts(4, 10, 30, seed=7)
    default = make_llm(path, kv_cache_dtype="fp8")
    assert {(layer.k_scale, layer.v_scale) for layer in default.engine.runner.attention_layers} == {(1.0, 1.0)}
    want = generate(default, batch)
    # K and V / 1e-4 saturate at +-448: the cache then holds K and V clipped to +-0.0448
    scaled = make_llm(path, kv_cache_dtype="fp8", kv_cache_scale=1e-4)
    layers = scaled.engine.runner.attention_layers
    assert len(layers) > 1 and {(layer.k_scale, layer.v_scale) for layer in layers} == {(1e-4, 1e-4)}
    got = generate(scaled, batch)
    assert first_logprob_error(got, want) > 0.01


def test_set_kv_scales_takes_checkpoint_tensors_and_rejects_bad_ones():
    layer = Attention(4, 2, 16, 0.25)
    set_kv_scales(layer, torch.tensor(0.5), torch.tensor([2.0]))
    assert (layer.k_scale, layer.v_scale) == (0.5, 2.0) and isinstance(layer.k_scale, float)
    set_kv_scales(layer, 3, 0.25)
    assert (layer.k_scale, layer.v_scale) == (3.0, 0.25)
    for bad in (0.0, -1.0, float("inf"), float("nan"), torch.ones(2)):
        with pytest.raises(ValueError):
            set_kv_scales(layer, bad, 1.0)


def test_fp8_cache_on_triton_needs_compute_capability_8_9(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        choose_kv_cache_dtype("fp8", torch.bfloat16, cuda, "triton")
    assert choose_kv_cache_dtype("auto", torch.bfloat16, cuda, "triton") == torch.bfloat16
    assert choose_kv_cache_dtype("fp8", torch.bfloat16, cuda, "torch") == FP8_KV_DTYPE
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert choose_kv_cache_dtype("fp8", torch.bfloat16, cuda, "triton") == FP8_KV_DTYPE


def test_kv_cache_scale_without_an_fp8_cache_warns(caplog):
    layers = [Attention(4, 2, 16, 0.25) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="roseray.engine.kv_cache"):
        set_kv_cache_scales(layers, {}, 0.5, FP8_KV_DTYPE)
        assert not caplog.records
        set_kv_cache_scales(layers, {}, 0.25, torch.bfloat16)
    assert "no effect on a bfloat16 KV cache" in caplog.records[0].getMessage()
    assert {(layer.k_scale, layer.v_scale) for layer in layers} == {(0.25, 0.25)}
