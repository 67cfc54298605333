"""Tensor parallelism on two GPUs (NCCL, CUDA graphs capturing the collectives): TP=2 gives TP=1's
greedy ids in fp32, and bf16 TP=2 is compared with bf16 TP=1 (agreement reported to $GPU_REPORT).
Skipped without two CUDA devices (run on a 2-GPU host)."""

from __future__ import annotations

import random

import pytest
import torch

from roseray import LLM, SamplingParams
from tests.models.gpu_helpers import generate_and_free, greedy_report

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
MAX_NEW = 32


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(4, 60))] for _ in range(24)]


def run(path, batch, dtype, tp):
    # max_num_seqs 32: six decode graphs, not twenty, per engine (the test builds four per kind)
    llm = LLM(str(path), device="cuda", dtype=dtype, tensor_parallel_size=tp, gpu_memory_utilization=0.3,
              max_num_batched_tokens=64, max_num_seqs=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    workers = llm.engine.tp_workers
    outputs = generate_and_free(llm, batch, params)
    if workers is not None:
        assert llm.engine.runner.graphs, "decode steps must replay CUDA graphs that captured the all-reduces"
        workers.stop()  # hung in NCCL's teardown while the graphs that captured its collectives lived
        assert not llm.engine.runner.graphs
        assert all(p.exitcode == 0 for p in workers.processes), [p.exitcode for p in workers.processes]
    return outputs


# the MoE families run the fused-MoE kernel at 1/2 of their experts' intermediate size per rank
@pytest.mark.timeout(600)  # a rank waiting in a collective fails the test instead of the run
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mixtral", "gpt_oss", "gemma2", "gemma3", "phi3"])
def test_two_gpus_match_one(kind, tiny_checkpoint):
    path, batch = tiny_checkpoint(kind), prompts()
    one = run(path, batch, "float32", 1)
    two = run(path, batch, "float32", 2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    one, two = run(path, batch, "bfloat16", 1), run(path, batch, "bfloat16", 2)
    errors = [max(abs(lp - o.logprobs[0][t]) for t, lp in w.logprobs[0].items() if t in o.logprobs[0])
              for w, o in zip(two, one)]
    report = greedy_report([o.token_ids for o in two], [o.token_ids for o in one], MAX_NEW, errors,
                           test="bf16 TP=2 vs TP=1", kind=kind)
    assert report["greedy_agreement"] > 0.5, report
