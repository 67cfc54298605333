"""On a CUDA device: the Triton backend and CUDA graphs give the same greedy tokens as
transformers and as eager mode. Skipped without a GPU (run on the GPU host)."""

from __future__ import annotations

import asyncio
import importlib
import json
import random

import jsonschema
import pytest
import torch
import transformers

from roseray import LLM, SamplingParams
from roseray.config import EngineConfig
from roseray.runtime.async_engine import AsyncLLMEngine
from roseray.runtime.process_client import EngineProcessClient
from roseray.sampling_params import StructuredOutputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def batch(n=24, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(1, 60))] for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt2", "qwen3_moe", "mixtral"])
def model_path(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


def test_triton_and_cuda_graphs_match_hf_fp32(model_path):
    prompts = batch()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    expected = []
    for p in prompts:
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    for eager in (True, False):
        llm = LLM(str(model_path), device="cuda", dtype="float32", attention_backend="triton", enforce_eager=eager,
                  block_size=16, max_num_batched_tokens=64, gpu_memory_utilization=0.3)
        assert bool(llm.engine.runner.graphs) == (not eager)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        llm.engine.check_integrity()
        assert got == expected, f"eager={eager}"
        if not eager:  # steps with prefill chunks ran as piecewise graphs
            assert llm.engine.runner.piecewise.num_replays > 0
        del llm
        torch.cuda.empty_cache()


def test_greedy_rows_beside_sampled_rows_in_graphs_match_hf(model_path):
    """Decode graphs take the tokens in flight from their own argmax, or from the sampler's
    output when the step had sampled rows: greedy rows keep transformers' tokens either way."""
    prompts = batch(12, seed=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(str(model_path), device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=64,
              gpu_memory_utilization=0.3)
    params = [GREEDY if i % 2 == 0 else SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    for i, (p, o) in enumerate(zip(prompts, outs)):
        if i % 2 == 0:
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            assert o.outputs[0].token_ids == ref, i
        else:
            assert len(o.outputs[0].token_ids) == 16
    del llm
    torch.cuda.empty_cache()


def test_prefix_cache_hits_on_split_kv_attention_match_hf_fp32(model_path, monkeypatch):
    """Short prompt tails after a cached 96-token prefix: with splits allowed from 16 keys (the tiny
    models' contexts are short), the general attention runs split-KV on the step after the hit, in
    eager mode and between piecewise graphs, and gives transformers' tokens."""
    paged_attention_module = importlib.import_module("roseray_kernels.paged_attention")
    monkeypatch.setattr(paged_attention_module, "MIN_KEYS_PER_GENERAL_SPLIT", 16)
    chosen, choose = [], paged_attention_module.choose_general_splits

    def recorded_choice(*args) -> int:
        chosen.append(choose(*args))
        return chosen[-1]

    monkeypatch.setattr(paged_attention_module, "choose_general_splits", recorded_choice)
    rng = random.Random(4)
    shared = [rng.randrange(3, 200) for _ in range(96)]
    prompts = [shared + [rng.randrange(3, 200) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    expected = [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    for eager in (True, False):
        chosen.clear()
        llm = LLM(str(model_path), device="cuda", dtype="float32", attention_backend="triton", enforce_eager=eager,
                  block_size=16, enable_prefix_caching=True, gpu_memory_utilization=0.3)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], GREEDY, use_tqdm=False)]
        got += [o.outputs[0].token_ids for o in llm.generate(prompts[1:], GREEDY, use_tqdm=False)]
        assert llm.engine.get_stats().prefix_cache_hits >= 3 * 96
        llm.engine.check_integrity()
        assert max(chosen) > 1, chosen
        assert got == expected, f"eager={eager}"
        del llm
        torch.cuda.empty_cache()


def test_bf16_graphs_equal_eager(model_path):
    prompts = batch(64, seed=1)
    outs = []
    for eager in (True, False):
        llm = LLM(str(model_path), device="cuda", dtype="bfloat16", enforce_eager=eager, gpu_memory_utilization=0.3,
                  max_num_batched_tokens=256)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        del llm
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_engine_process_on_cuda_equals_offline(model_path):
    """The serving default on CUDA: the engine loop in a child process (CUDA graphs,
    piecewise graphs, async scheduling) streams the same greedy tokens as LLM.generate."""
    prompts = batch(16, seed=2)
    llm = LLM(str(model_path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
              max_num_batched_tokens=128)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()

    async def serve_all():
        engine = AsyncLLMEngine.from_engine_config(EngineConfig(
            model=str(model_path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3,
            max_num_batched_tokens=128))
        assert isinstance(engine.client, EngineProcessClient)  # the default on CUDA
        engine.start()

        async def one(i, prompt):
            stream = await engine.add_request(f"g{i}", prompt, GREEDY)
            return [t async for deltas in stream for d in deltas for t in d.new_token_ids]

        try:
            return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        finally:
            await engine.shutdown()

    assert asyncio.run(serve_all()) == expected


def test_constrained_outputs_validate_with_graphs_and_overlap(model_path):
    """Structured outputs on CUDA: bf16, CUDA graphs, async scheduling (the mask of a step filled
    while its forward runs), the Triton mask kernel, batched with unconstrained rows."""
    schema = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "name": {"type": "string", "maxLength": 5}}, "required": ["id", "tags", "name"], "additionalProperties": False}
    llm = LLM(str(model_path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, max_num_batched_tokens=64)
    assert llm.engine.overlap and llm.engine.runner.graphs
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(1, 30))] for _ in range(32)]
    params = [SamplingParams(temperature=1.0 if i % 3 else 0.0, max_tokens=90, seed=i,
                             structured_outputs=StructuredOutputs.json_schema(schema, any_whitespace=False))
              if i % 2 else SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True) for i in range(32)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output in outputs[1::2]:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
    llm.engine.check_integrity()
