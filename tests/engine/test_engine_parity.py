"""Greedy token ids equal Hugging Face transformers' generate, through roseray's real
loading path, under batching, chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from roseray import LLM, SamplingParams
from tests.models.hf_models import make_tiny_model, use_longrope_long_factors

# mistral (when windowed), mixtral, gpt_oss, gemma2, gemma3 and phi3 slide a window of 8 tokens that most
# prompts below cross
KINDS = ["gpt2", "llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss", "gemma2", "gemma3", "phi3",
         "phi3-longrope"]
MAX_NEW = 12


@pytest.fixture(scope="module", params=KINDS)
def tiny_model(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    hf = use_longrope_long_factors(hf)  # LongRoPE's factors chosen as roseray does
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return request.param, path, hf


def hf_greedy(hf, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def run(path, batch, **engine_args):
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, async_scheduling=True, **engine_args)
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    llm.engine.check_integrity()
    return llm, [o.outputs[0].token_ids for o in outputs]


def test_single_prompt(tiny_model):
    _, path, hf = tiny_model
    prompt = prompts(1, 9, 9)[0]
    _, got = run(path, [prompt])
    assert got[0] == hf_greedy(hf, prompt)


def test_batch_of_mixed_lengths(tiny_model):
    _, path, hf = tiny_model
    batch = prompts(6, 1, 30, seed=1)
    _, got = run(path, batch)
    assert got == [hf_greedy(hf, p) for p in batch]


def test_chunked_prefill_small_budget(tiny_model):
    _, path, hf = tiny_model
    batch = prompts(4, 20, 40, seed=2)
    llm, got = run(path, batch, max_num_batched_tokens=7, max_num_seqs=4)
    assert got == [hf_greedy(hf, p) for p in batch]


def test_prefix_caching_with_shared_prefixes(tiny_model):
    _, path, hf = tiny_model
    shared = prompts(1, 13, 13, seed=3)[0]
    batch = [shared + tail for tail in prompts(4, 1, 6, seed=4)]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, enable_prefix_caching=True,
              async_scheduling=True)
    first = [o.outputs[0].token_ids for o in llm.generate(batch[:1], GREEDY, use_tqdm=False)]
    rest = [o.outputs[0].token_ids for o in llm.generate(batch[1:], GREEDY, use_tqdm=False)]
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits >= 3 * 12  # three later prompts reuse the 3 full shared blocks
    llm.engine.check_integrity()
    assert first + rest == [hf_greedy(hf, p) for p in batch]


def test_preemption_by_recompute(tiny_model):
    _, path, hf = tiny_model
    batch = prompts(6, 10, 20, seed=5)
    # 16 blocks of 4 tokens: each request needs up to 8 blocks, six of them cannot run together
    llm, got = run(path, batch, num_kv_blocks=16, max_num_seqs=6, enable_prefix_caching=False)
    assert llm.engine.get_stats().num_preemptions_total > 0
    assert got == [hf_greedy(hf, p) for p in batch]
