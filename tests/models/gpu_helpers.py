"""Shared by the GPU model tests: generating and freeing the GPU, and agreement figures appended as
JSON lines to $GPU_REPORT when it is set."""

from __future__ import annotations

import json
import os

import torch


def greedy_report(got: list[list[int]], want: list[list[int]], max_new: int, errors: list[float],
                  **fields) -> dict:
    """Greedy agreement (tokens before the first difference, over all) and first-token
    log-probability errors of `got` against `want`; written to $GPU_REPORT."""
    matched = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), max_new) for g, w in zip(got, want)]
    report = {**fields, "prompts": len(got), "tokens_each": max_new,
              "greedy_agreement": sum(matched) / (max_new * len(got)),
              "identical_sequences": sum(m == max_new for m in matched),
              "first_token_logprob_max_abs_err": max(errors),
              "first_token_logprob_mean_abs_err": sum(errors) / len(errors)}
    if os.environ.get("GPU_REPORT"):
        with open(os.environ["GPU_REPORT"], "a") as f:
            f.write(json.dumps(report) + "\n")
    return report


def generate_and_free(llm, batch, params) -> list:
    """Each prompt's first completion; the engine's blocks checked, then the engine and its GPU memory freed."""
    outputs = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
    llm.engine.check_integrity()
    del llm
    torch.cuda.empty_cache()
    return outputs
