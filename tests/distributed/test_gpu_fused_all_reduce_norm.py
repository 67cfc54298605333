"""Tensor parallelism on two GPUs with ROSERAY_TP_ALL_REDUCE=triton, where the Llama decoder's add+RMSNorms
take the blocks' all-reduces (RMSNorm.all_reduce_add: one fused launch each, captured in the decode and the
piecewise CUDA graphs): TP=2 gives TP=1's greedy ids in fp32 on tiny Llama and Qwen3, and rank 0 ran the fused
kernel. Each TP=2 engine runs in a process of its own (spawned), for the triton method allows one
tensor-parallel engine per process. Skipped without two CUDA devices."""

from __future__ import annotations

import gc
import os
import queue
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from roseray.envs import TP_ALL_REDUCE_ENV
from roseray.triton_all_reduce import TritonAllReduce
from tests.distributed.test_gpu_tensor_parallel import prompts, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
ENGINE_TIMEOUT_S = 400


def _triton_engine(path: str, results) -> None:
    """Rank 0 of a TP=2 fp32 engine with the triton method: its greedy ids and how often it launched the
    fused all-reduce + add + RMSNorm (eagerly and while capturing graphs; replays launch it too, unseen)."""
    os.environ[TP_ALL_REDUCE_ENV] = "triton"  # read as the group starts; the workers inherit it
    launches = [0]
    fused = TritonAllReduce.add_rmsnorm

    def counted(self, *args):
        launches[0] += 1
        return fused(self, *args)

    TritonAllReduce.add_rmsnorm = counted
    try:
        outputs = run(path, prompts(), "float32", 2)
    except BaseException:  # the parent reports it at once (its own pytest capture would hide it)
        results.put(("error", traceback.format_exc()))
        raise
    results.put(([o.token_ids for o in outputs], launches[0]))


def _result(process, results, timeout_s: float):
    """The child's result, or a failure as soon as it exits without one (not after the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not process.is_alive():
                pytest.fail(f"the TP=2 engine's process exited (code {process.exitcode}) without a result")
    pytest.fail(f"the TP=2 engine gave no result within {timeout_s} s")


@pytest.mark.timeout(2 * ENGINE_TIMEOUT_S)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_two_gpus_with_the_fused_all_reduce_norm_match_one(kind, tiny_checkpoint):
    path = tiny_checkpoint(kind)
    one = [o.token_ids for o in run(path, prompts(), "float32", 1)]
    gc.collect()
    torch.cuda.empty_cache()  # this process's cached blocks on GPU 0 would count against the child's share
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_triton_engine, args=(str(path), results))
    process.start()
    try:
        two, launches = _result(process, results, ENGINE_TIMEOUT_S)
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()
    assert two != "error", launches  # the child's traceback
    assert process.exitcode == 0, process.exitcode
    assert launches > 0, "rank 0 never ran the fused all-reduce + add + RMSNorm (the triton method not in use?)"
    assert two == one
