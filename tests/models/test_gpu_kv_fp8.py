"""fp8 (e4m3) KV cache against the bf16 one on a CUDA device, through the Triton kernels and CUDA graphs:
greedy agreement, first-token log-probability error and KV capacity, written to $GPU_REPORT when set
(one JSON line per model kind). Skipped without a GPU (run on the GPU host)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from roseray import LLM, SamplingParams
from tests.models.test_gpu_models import MAX_NEW, TOP, prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def run(path, batch, kv_cache_dtype: str, kv_cache_scale: float | None = None):
    llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend="triton", block_size=16,
              max_num_batched_tokens=64, gpu_memory_utilization=0.3, kv_cache_dtype=kv_cache_dtype,
              kv_cache_scale=kv_cache_scale)
    assert str(llm.engine.runner.kv_cache.dtype) == ("torch.float8_e4m3fn" if kv_cache_dtype == "fp8" else
                                                     "torch.bfloat16")
    assert llm.engine.runner.graphs, "decode steps must run as CUDA graphs"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP)
    outputs = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
    llm.engine.check_integrity()
    blocks = llm.engine.runner.num_blocks
    del llm
    torch.cuda.empty_cache()
    return outputs, blocks


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "gpt_oss"])
def test_fp8_kv_cache_against_bf16(tiny_checkpoint, kind):
    """llama, qwen3: plain GQA; gemma2: sliding window and softcaps; gpt_oss: window and sinks."""
    path = tiny_checkpoint(kind)
    batch = prompts(32)
    bf16, bf16_blocks = run(path, batch, "auto")
    fp8, fp8_blocks = run(path, batch, "fp8")
    matched = [next((i for i, (a, b) in enumerate(zip(o.token_ids, e.token_ids)) if a != b), MAX_NEW)
               for o, e in zip(fp8, bf16)]
    errors = [max(abs(lp - ref.logprobs[0][t]) for t, lp in o.logprobs[0].items() if t in ref.logprobs[0])
              for o, ref in zip(fp8, bf16)]
    report = {"test": "fp8_kv_vs_bf16_kv", "kind": kind, "prompts": len(batch), "tokens_each": MAX_NEW,
              "greedy_agreement": sum(matched) / (MAX_NEW * len(batch)),
              "identical_sequences": sum(m == MAX_NEW for m in matched),
              "first_token_logprob_max_abs_err": max(errors),
              "first_token_logprob_mean_abs_err": sum(errors) / len(errors),
              "kv_blocks_bf16": bf16_blocks, "kv_blocks_fp8": fp8_blocks}
    if os.environ.get("GPU_REPORT"):
        with open(os.environ["GPU_REPORT"], "a") as f:
            f.write(json.dumps(report) + "\n")
    assert fp8_blocks >= 1.9 * bf16_blocks, report  # the same budget, half the bytes a block
    assert report["first_token_logprob_max_abs_err"] < 0.2, report
    assert report["greedy_agreement"] > 0.5, report
