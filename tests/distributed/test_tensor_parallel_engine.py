"""The engine at tensor_parallel_size 2 on CPU (rank 0 here, one worker process over gloo): greedy
ids equal transformers' generate under batching, chunked prefill, prefix caching and preemption
(Llama, Qwen3; the other families that shard equal the one-rank engine's);
tokens sampled on rank 0 (a top-k-1 sampler, not the argmax path) reach the worker, and so do those
of constrained steps sampled a call late with async scheduling; the worker stops with the engine."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import psutil
import pytest
import torch
import transformers

from roseray import LLM, SamplingParams
from roseray.sampling_params import StructuredOutputs
from tests.models.hf_models import make_tiny_model
from tests.waiting import wait_until

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def greedy(prompt):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
        return out[0, len(prompt):].tolist()

    return path, greedy


def run(path, batches, params=GREEDY, completions=False, **engine_args):
    """Each batch generated in turn by one TP=2 engine; all outputs' token ids (their completions with
    `completions`), and the engine's stats."""
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=2, **engine_args)
    got = [o.outputs[0] for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]
    got = got if completions else [c.token_ids for c in got]
    llm.engine.check_integrity()
    stats = llm.engine.get_stats()
    workers = llm.engine.tp_workers.processes
    assert all(p.is_alive() for p in workers)
    llm.engine.tp_workers.stop()  # rank 0 sends STOP and joins its worker (at exit, or when the runner goes)
    assert not any(p.is_alive() for p in workers) and all(p.exitcode == 0 for p in workers)
    return got, stats


def test_batch_and_chunked_prefill_equal_transformers(tiny):
    path, greedy = tiny
    batch = prompts(5, 1, 30, seed=1)
    got, _ = run(path, [batch], max_num_batched_tokens=7, max_num_seqs=4)
    assert got == [greedy(p) for p in batch]


def test_prefix_caching_and_preemption_equal_transformers(tiny):
    path, greedy = tiny
    shared = prompts(1, 13, 13, seed=3)[0]
    batch = [shared + tail for tail in prompts(3, 1, 6, seed=4)] + prompts(3, 10, 20, seed=5)
    got, stats = run(path, [batch[:1], batch[1:]], num_kv_blocks=16, max_num_seqs=6)
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    assert got == [greedy(p) for p in batch]


def test_tokens_sampled_on_rank_0_reach_the_worker(tiny):
    path, greedy = tiny
    batch = prompts(4, 3, 20, seed=6)
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_NEW, ignore_eos=True, seed=0)
    got, _ = run(path, [batch], params=top1)
    assert got == [greedy(p) for p in batch]


def test_constrained_requests_with_async_scheduling_give_the_one_step_tokens(mask_ready):
    """Rank 0 samples a constrained step through its grammar mask after the forward (held to the next
    call, before or after that call prepares the next step) and sends those tokens to the worker: the
    same tokens as one step at a time, every JSON output valid."""
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["id", "tags"], "additionalProperties": False}
    constrained = StructuredOutputs("json", json.dumps(schema))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=constrained) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True) for i in range(4)]
    results = []
    for overlap in (False, True):
        llm = LLM("random:tiny", device="cpu", dtype="float32", tensor_parallel_size=2, async_scheduling=overlap,
                  seed=3)
        assert llm.engine.overlap is overlap
        outputs = [o.outputs[0] for o in llm.generate([f"p{i}" for i in range(4)], params, use_tqdm=False)]
        for output in outputs[1::2]:
            assert output.finish_reason == "stop" and set(json.loads(output.text)) == {"id", "tags"}
        results.append([o.token_ids for o in outputs])
        llm.engine.check_integrity()
        llm.engine.tp_workers.stop()
    assert results[0] == results[1]


# The families beyond Llama/Qwen3 that shard: MoE experts (Qwen3-MoE with a dense layer, Mixtral's windows),
# gpt-oss (sinks, expert biases, windows), Gemma 2/3 (softcaps, windows), Phi-3 (fused checkpoint tensors).
OTHER_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "gemma2", "gemma3", "phi3")


@pytest.mark.parametrize("kind", OTHER_FAMILIES)
def test_other_families_equal_one_rank_under_chunked_prefill_and_preemption(kind, tiny_checkpoint):
    """Prompts past the tiny models' 8-token windows, prefilled in 7-token chunks with a prefix shared
    and too few KV blocks for them all: TP=2's greedy ids are TP=1's (whose parity with transformers
    tests/models/test_models.py checks), and so are its top logprobs (the tiny gpt-oss repeats one
    token whatever its sinks: the logprobs show them)."""
    path = tiny_checkpoint(kind)
    shared = prompts(1, 13, 13, seed=3)[0]
    batch = [shared + tail for tail in prompts(3, 1, 6, seed=4)] + prompts(3, 10, 20, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    got, stats = run(path, [batch[:1], batch[1:]], params, completions=True, max_num_batched_tokens=7,
                     num_kv_blocks=16, max_num_seqs=6)
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    one = LLM(str(path), device="cpu", dtype="float32", block_size=4)
    want = [o.outputs[0] for o in one.generate(batch, params, use_tqdm=False)]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        for got_step, want_step in zip(g.logprobs, w.logprobs, strict=True):
            assert got_step.keys() == want_step.keys()
            assert all(abs(got_step[t] - want_step[t]) < 1e-4 for t in want_step), (got_step, want_step)


def test_a_worker_that_dies_fails_the_next_step_with_its_rank_named(tiny):
    path, _ = tiny
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=2)
    worker = llm.engine.tp_workers.processes[0]
    worker.kill()
    worker.join(10)
    outputs = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert llm.engine.check_integrity() is None  # the failed step's blocks are back
    llm.engine.tp_workers.stop()


KILLED_RANK_0 = """
import os, signal, sys
from roseray import LLM
if __name__ == "__main__":  # the workers are spawned: they import this module
    llm = LLM(sys.argv[1], device="cpu", dtype="float32", block_size=4, tensor_parallel_size=2)
    print(llm.engine.tp_workers.processes[0].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_rank_0_takes_its_worker_with_it(tiny, tmp_path):
    path, _ = tiny
    script = tmp_path / "rank0.py"
    script.write_text(KILLED_RANK_0)
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    worker = int(done.stdout.split()[0])
    wait_until(lambda: not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE,
               timeout=30, message="the worker did not exit with rank 0")
