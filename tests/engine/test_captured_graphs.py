"""CapturedGraphs.release destroys a runner's graphs (decode and piecewise) and leaves it eager;
on a GPU the graphs' CUDA objects are gone, which NCCL's teardown under tensor parallelism waits for."""

import gc
import weakref

import pytest
import torch

from roseray import LLM, SamplingParams


def test_release_leaves_an_eager_runner_that_still_generates():
    llm = LLM("random:tiny", device="cpu", dtype="float32")
    runner = llm.engine.runner
    runner.captured.release()
    assert not runner.graphs and runner.piecewise is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_release_destroys_the_graphs_on_the_gpu():
    llm = LLM("random:tiny", device="cuda", gpu_memory_utilization=0.2, max_num_seqs=8)
    runner = llm.engine.runner
    graphs = [weakref.ref(g) for g in runner.graphs.values()]
    pieces = [weakref.ref(p) for g in runner.piecewise.graphs.values() for p in g.pieces]
    assert graphs and pieces
    runner.captured.release()
    gc.collect()
    assert all(ref() is None for ref in graphs + pieces)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
