"""The benchmark workloads of BENCHMARKS.md, generated exactly as specified there."""

from __future__ import annotations

import random

from roseray.sampling_params import SamplingParams

NANO_MODEL = "random:qwen3-0.6b"
SEED_MODEL = "random:gpt2"
SEED_PROMPT_TOKEN = 15496


def nano_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024):
    """W-nano: prompts of random ids, then per-request output lengths (Python `random`, seed 0)."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    return prompts, params


def seed_workload(num_requests: int = 128, max_tokens: int = 128):
    """W-seed: every request is the single token 15496, greedy, 128 tokens, ignore_eos."""
    prompts = [[SEED_PROMPT_TOKEN] for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens) for _ in range(num_requests)]
    return prompts, params
