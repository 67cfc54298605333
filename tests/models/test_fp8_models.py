"""FP8 weights through roseray's real loading code (CPU, fp32 activations; the reference path
computes with the dequantized weights, which transformers is given as its weights):

- `quantization="fp8"` turns every decoder linear layer into e4m3 with per-channel scales;
- a checkpoint written by us in each fp8 format loads: per-tensor and per-channel formats give
  transformers' greedy ids on the dequantized weights exactly (under batching, chunked prefill,
  prefix caching and preemption), and the per-channel one the same ids as the dynamic path;
  block formats are requantized per channel (weights within e4m3's rounding of the checkpoint);
- K/V scales are collected, static activation scales dropped, unsupported formats refused;
- MoE models (Qwen3-MoE, Mixtral): a checkpoint with fp8 experts in each format loads into
  FusedMoE's e4m3 experts (routers in the model's dtype); per-channel it is the dynamic path
  exactly, per-tensor exactly its dequantized weights, and every format within the dynamic
  path's log-probabilities.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from roseray import LLM, SamplingParams
from roseray.config import EngineConfig
from roseray.distributed import TensorParallel
from roseray.layers.fp8_linear import Fp8Linear
from roseray.layers.moe import FusedMoE
from roseray.layers.norms import RMSNorm
from roseray.models import loader
from roseray.models.llama import LlamaDecoderLayer, LlamaMLP
from roseray.models.loader import load_model_config
from roseray_kernels.fp8_quant import FP8_DTYPE
from tests.models.fp8_checkpoints import FORMATS, write_fp8_checkpoint
from tests.models.hf_models import load_hf_model

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
KINDS = ["llama", "qwen2", "qwen3"]  # GQA, q/k/v biases, q/k norms


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(path, batch, **engine_args):
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, **engine_args)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    llm.engine.check_integrity()
    return llm, got


def hf_on(path, dequantized: dict[str, torch.Tensor]):
    """transformers' model of `path` (fp32) with `dequantized` as its linear weights."""
    hf = load_hf_model(path)
    state = hf.state_dict()
    missing = set(dequantized) - set(state)
    assert not missing, missing
    with torch.no_grad():
        for name, weight in dequantized.items():
            state[name].copy_(weight)
    return hf


def hf_greedy(hf, prompt):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=KINDS)
def source(request, tiny_checkpoint):
    return request.param, tiny_checkpoint(request.param)


def test_dynamic_quantization_makes_every_decoder_linear_fp8(source):
    _, path = source
    llm = LLM(str(path), device="cpu", dtype="float32", quantization="fp8")
    model = llm.engine.runner.model
    fp8 = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    plain = [name for name, m in model.named_modules() if type(m) in (nn.Linear,) and not name.endswith("lm_head")]
    assert fp8 and not plain, plain
    assert all(m.weight.dtype == FP8_DTYPE and m.weight_scale.shape == (m.out_features,) for m in fp8.values())
    assert not any(isinstance(m, Fp8Linear) for name, m in model.named_modules() if name.endswith("lm_head"))


def test_llama_family_norms_quantize_for_their_fp8_projection(source, tiny_checkpoint):
    """Each Llama-family layer's two norms hand their fp8 projection (q|k|v, gate|up) its rows
    quantized (RMSNorm.fp8_consumer, their weight shape); norms read by anything else do not."""
    kind, path = source
    model = LLM(str(path), device="cpu", dtype="float32", quantization="fp8").engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert layers
    for layer in layers:
        assert layer.input_layernorm.fp8_consumer == tuple(layer.self_attn.qkv_proj.weight.shape)
        assert layer.post_attention_layernorm.fp8_consumer == tuple(layer.mlp.gate_up_proj.weight.shape)
    moe = LLM(str(tiny_checkpoint("qwen3_moe")), device="cpu", dtype="float32", quantization="fp8").engine.runner.model
    moe_layers = [m for m in moe.modules() if isinstance(m, LlamaDecoderLayer)]
    sparse = [layer for layer in moe_layers if not isinstance(layer.mlp, LlamaMLP)]
    assert sparse and all(layer.input_layernorm.fp8_consumer is not None for layer in moe_layers)
    assert all(layer.post_attention_layernorm.fp8_consumer is None for layer in sparse)  # the router reads it
    bf16 = LLM(str(path), device="cpu", dtype="float32").engine.runner.model
    assert all(m.fp8_consumer is None for m in bf16.modules() if isinstance(m, RMSNorm))


def test_per_channel_checkpoint_equals_dynamic_path_and_transformers(source, tmp_path):
    """The checkpoint our per-channel quantization writes: the same ids as quantizing at load, and
    transformers' ids on its dequantized weights, batched, with chunked prefill, prefix caching
    and preemption."""
    _, path = source
    dequantized = write_fp8_checkpoint(path, tmp_path / "ct", "ct-channel")
    hf = hf_on(path, dequantized)
    batch = prompts(6, 1, 30, seed=1)
    want = [hf_greedy(hf, p) for p in batch]
    _, dynamic = run(path, batch, quantization="fp8")
    _, loaded = run(tmp_path / "ct", batch)
    assert loaded == dynamic == want
    long = prompts(4, 20, 40, seed=2)
    _, chunked = run(tmp_path / "ct", long, max_num_batched_tokens=7, max_num_seqs=4)
    assert chunked == [hf_greedy(hf, p) for p in long]
    shared = prompts(1, 13, 13, seed=3)[0]
    prefixed = [shared + tail for tail in prompts(4, 1, 6, seed=4)]
    llm, got = run(tmp_path / "ct", prefixed, enable_prefix_caching=True, max_num_seqs=1)
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert got == [hf_greedy(hf, p) for p in prefixed]
    crowded = prompts(6, 10, 20, seed=5)
    llm, got = run(tmp_path / "ct", crowded, num_kv_blocks=16, max_num_seqs=6, enable_prefix_caching=False)
    assert llm.engine.get_stats().num_preemptions_total > 0
    assert got == [hf_greedy(hf, p) for p in crowded]


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "ct-channel"])
def test_each_fp8_format_loads_its_weights(source, tmp_path, fmt):
    kind, path = source
    dequantized = write_fp8_checkpoint(path, tmp_path / fmt, fmt)
    batch = prompts(4, 3, 25, seed=6)
    llm, got = run(tmp_path / fmt, batch)
    model = llm.engine.runner.model
    loaded = {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert loaded and all(m.weight.dtype == FP8_DTYPE and not hasattr(m, "weight_scale_inv") for m in loaded.values())
    qkv = next(m for name, m in loaded.items() if name.endswith("layers.0.self_attn.qkv_proj"))
    weight = qkv.weight.float() * qkv.weight_scale[:, None]
    want = torch.cat([dequantized[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    if fmt.endswith("block"):  # requantized per channel: within e4m3's rounding of the checkpoint's weights
        assert float((weight - want).norm() / want.norm()) < 0.04
    else:  # per-tensor scales fill their part's rows: the very same weights
        assert torch.equal(weight, want)
        hf = hf_on(path, dequantized)
        assert got == [hf_greedy(hf, p) for p in batch]


def test_checkpoint_kv_scales_reach_an_fp8_cache_and_static_activation_scales_are_dropped(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    write_fp8_checkpoint(path, tmp_path / "ct", "ct-tensor", kv_scales=0.5, static_activations=True)
    llm = LLM(str(tmp_path / "ct"), device="cpu", dtype="float32")
    assert llm.engine.runner.model.kv_cache_scales == {0: {"k": 0.5, "v": 0.5}, 1: {"k": 1.0, "v": 1.0}}
    assert [(a.k_scale, a.v_scale) for a in llm.engine.runner.attention_layers] == [(1.0, 1.0)] * 2  # not fp8 KV
    llm = LLM(str(tmp_path / "ct"), device="cpu", dtype="float32", kv_cache_dtype="fp8")
    assert [(a.k_scale, a.v_scale) for a in llm.engine.runner.attention_layers] == [(0.5, 0.5), (1.0, 1.0)]
    llm = LLM(str(tmp_path / "ct"), device="cpu", dtype="float32", kv_cache_dtype="fp8", kv_cache_scale=0.25)
    assert [(a.k_scale, a.v_scale) for a in llm.engine.runner.attention_layers] == [(0.25, 0.25)] * 2


def _with_quantization_config(src, dst, qc):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "awq", "bits": 4}, "unsupported quantization method 'awq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}},
     "unsupported compressed-tensors checkpoint (4-bit int weights"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 checkpoint format 'e5m2' is unsupported"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
     "fp8 checkpoint scale format 'ue8m0' is unsupported"),
])
def test_unsupported_quantization_fails_at_config_time_with_one_line(tiny_checkpoint, tmp_path, qc, message):
    path = _with_quantization_config(tiny_checkpoint("llama"), tmp_path / "q", qc)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace("'", "'")) as info:
        load_model_config(str(path))
    assert "\n" not in str(info.value)


MOE_KINDS = ["qwen3_moe", "mixtral"]  # experts named mlp.experts.{e}.gate_proj / block_sparse_moe.experts.{e}.w1


def first_token_logprobs(path, batch, **engine_args):
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outputs = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
    return llm, [o.token_ids for o in outputs], [o.logprobs[0] for o in outputs]


def _dequantized_copy(src, dst, dequantized):
    """`src` with `dequantized` as its weights, in fp32: what an fp8 checkpoint stands for."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, **dequantized}, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_fp8_moe_checkpoint_in_each_format_loads_into_fp8_experts(kind, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(kind)
    batch = prompts(4, 3, 25, seed=9)
    _, dynamic_ids, dynamic = first_token_logprobs(path, batch, quantization="fp8")
    for fmt in FORMATS:
        dequantized = write_fp8_checkpoint(path, tmp_path / fmt, fmt)
        assert any(".experts.3." in name for name in dequantized)
        llm, ids, got = first_token_logprobs(tmp_path / fmt, batch)
        model = llm.engine.runner.model
        routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        experts = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
        assert routers and all(type(m) is nn.Linear and m.weight.dtype == torch.float32 for m in routers)
        assert experts and all(m.w13.dtype == m.w2.dtype == FP8_DTYPE and m.w13_scale.shape == m.w13.shape[:2]
                               and m.w2_scale.shape == m.w2.shape[:2] and not hasattr(m, "w13_scale_inv")
                               for m in experts.values())
        moe = experts["model.layers.0.mlp.experts"]
        names = (("mlp.experts.3.{}_proj", ("gate", "up", "down")) if kind == "qwen3_moe"
                 else ("block_sparse_moe.experts.3.{}", ("w1", "w3", "w2")))
        gate, up, down = (dequantized[f"model.layers.0.{names[0].format(p)}.weight"] for p in names[1])
        want = {"w13": torch.cat([gate, up]), "w2": down}
        for name, w in want.items():
            weight = getattr(moe, name)[3].float() * getattr(moe, f"{name}_scale")[3, :, None]
            if fmt.endswith("block"):  # requantized per row: within e4m3's rounding of the checkpoint's weights
                assert float((weight - w).norm() / w.norm()) < 0.04
            else:  # per-tensor scales fill their part's rows: the very same weights
                assert torch.equal(weight, w), (fmt, name)
        for g, w in zip(got, dynamic):  # e4m3 roundings differ by format: as close as fp8 is to bf16
            common = set(g) & set(w)
            assert common and max(abs(g[t] - w[t]) for t in common) < 0.1, fmt
        if fmt == "ct-channel":  # what quantizing at load writes: the dynamic path exactly
            assert ids == dynamic_ids and got == dynamic
        elif fmt.endswith("tensor"):  # exactly the model of the dequantized weights
            plain = _dequantized_copy(path, tmp_path / f"{fmt}-dequantized", dequantized)
            _, plain_ids, plain_logprobs = first_token_logprobs(plain, batch)
            assert ids == plain_ids and got == plain_logprobs


def test_fp8_moe_checkpoint_with_transformers_scale_names_loads_the_same(tiny_checkpoint, tmp_path):
    """transformers names a per-tensor scale weight_scale_inv and a static one activation_scale."""
    write_fp8_checkpoint(tiny_checkpoint("qwen3_moe"), tmp_path / "vllm", "fp8-tensor")
    shutil.copytree(tmp_path / "vllm", tmp_path / "hf")
    tensors = load_file(tmp_path / "vllm" / "model.safetensors")
    renamed = {name.replace(".weight_scale", ".weight_scale_inv"): t for name, t in tensors.items()}
    scales = [name for name in renamed if name.endswith(".weight_scale_inv")]
    assert any(".experts." in name for name in scales)
    renamed |= {name.replace(".weight_scale_inv", ".activation_scale"): torch.tensor(0.05) for name in scales}
    save_file(renamed, tmp_path / "hf" / "model.safetensors")
    batch = prompts(3, 3, 12, seed=11)
    assert first_token_logprobs(tmp_path / "hf", batch)[1:] == first_token_logprobs(tmp_path / "vllm", batch)[1:]


def test_fp8_moe_checkpoint_may_leave_a_layers_experts_unquantized(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_moe")
    dequantized = write_fp8_checkpoint(path, tmp_path / "ct", "ct-block", keep="layers.0.mlp.experts.")
    assert not any("layers.0.mlp.experts." in name for name in dequantized)
    assert any("layers.2.mlp.experts." in name for name in dequantized)
    llm, ids, _ = first_token_logprobs(tmp_path / "ct", prompts(2, 3, 9, seed=10))
    model = llm.engine.runner.model
    kept, quantized = (model.get_submodule(f"model.layers.{i}.mlp.experts") for i in (0, 2))
    assert kept.w13.dtype == kept.w2.dtype == torch.float32 and kept.w13_scale is None
    gate = load_file(path / "model.safetensors")["model.layers.0.mlp.experts.1.gate_proj.weight"]
    assert torch.equal(kept.w13[1, : gate.shape[0]], gate)
    assert quantized.w13.dtype == FP8_DTYPE and quantized.w13_scale is not None
    assert all(len(t) == MAX_NEW for t in ids)


def test_fp8_moe_checkpoint_that_quantizes_only_some_experts_is_refused(tiny_checkpoint, tmp_path):
    write_fp8_checkpoint(tiny_checkpoint("qwen3_moe"), tmp_path / "moe", "fp8-tensor")
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.mlp.experts.5.up_proj"]
    (tmp_path / "moe" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="^the fp8 checkpoint quantizes only some experts of model.layers.0.mlp"):
        LLM(str(tmp_path / "moe"), device="cpu", dtype="float32")


def test_dynamic_fp8_on_a_moe_model_quantizes_the_experts_and_keeps_the_routers(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    batch = prompts(4, 3, 25, seed=8)
    logprobs = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    llm = LLM(str(path), device="cpu", dtype="float32", quantization="fp8")
    model = llm.engine.runner.model
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert routers and all(type(m) is nn.Linear for m in routers)
    assert experts and all(m.w13.dtype == m.w2.dtype == FP8_DTYPE for m in experts)
    got = [o.outputs[0].logprobs[0] for o in llm.generate(batch, logprobs, use_tqdm=False)]
    plain = LLM(str(path), device="cpu", dtype="float32")
    want = [o.outputs[0].logprobs[0] for o in plain.generate(batch, logprobs, use_tqdm=False)]
    for g, w in zip(got, want):  # e4m3 weights move these tiny models' log-probabilities a little
        common = set(g) & set(w)
        assert common and max(abs(g[t] - w[t]) for t in common) < 0.1


def test_fp8_moe_checkpoint_is_refused_under_tensor_parallelism(tiny_checkpoint, tmp_path, monkeypatch):
    write_fp8_checkpoint(tiny_checkpoint("mixtral"), tmp_path / "moe", "fp8-block")
    model_config = load_model_config(str(tmp_path / "moe"))
    monkeypatch.setattr(loader, "tensor_parallel", lambda: TensorParallel(rank=0, size=2))
    loader.check_tensor_parallel(model_config, fp8_checkpoint_weights=False)  # the bf16 path shards
    with pytest.raises(ValueError, match="^tensor_parallel_size 2 with an fp8 checkpoint is unsupported"):
        loader.check_tensor_parallel(model_config, fp8_checkpoint_weights=True)


def test_engine_config_refuses_unknown_quantization_and_kv_dtype():
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        EngineConfig(quantization="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="fp16")
