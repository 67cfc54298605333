"""gpt-oss specifics: YaRN RoPE against transformers' definition, MXFP4 expert weights
(dequantization against transformers', a checkpoint in the released format loading exactly
like its unquantized twin), config.json parsing and its one-line errors, dummy weights.
Logit and greedy parity with transformers: tests/models/test_models.py and
tests/engine/test_engine_parity.py (kind "gpt_oss")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from roseray.layers.attention import Attention, attention_metadata
from roseray.layers.rotary import RotaryEmbedding
from roseray.models.loader import load_model, load_model_config, model_config_from_hf
from roseray.models.mxfp4 import dequantize_mxfp4
from tests.models.helpers import step_metadata
from tests.models.hf_models import hf_config, load_hf_model, skip_unless_reference

# ---------------------------------------------------------------- YaRN


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096},  # gpt-oss
        {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096},  # truncated
        {"factor": 4.0, "original_max_position_embeddings": 32, "truncate": False},
        {"factor": 8.0, "original_max_position_embeddings": 512, "attention_factor": 0.75},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
        {"factor": 2.0, "original_max_position_embeddings": 1024, "beta_fast": 8.0, "beta_slow": 2.0},
    ],
)
def test_yarn_table_matches_transformers(params):
    head_dim, theta, max_position = 64, 150000.0, 8192
    rope = {"rope_type": "yarn", "rope_theta": theta, **params}
    config = GptOssConfig(head_dim=head_dim, max_position_embeddings=max_position, rope_parameters=dict(rope))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    want = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
    got = RotaryEmbedding(head_dim, max_position, theta, rope).cos_sin_cache
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not torch.allclose(got, RotaryEmbedding(head_dim, max_position, theta).cos_sin_cache, atol=1e-3)


# ---------------------------------------------------------------- MXFP4


def _random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (blocks, scales) for a [*shape] matrix stack: every code, scales 2**-7 .. 2**-2."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(120, 126, (*lead, cols // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_transformers():
    generator = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4((3, 10, 96), generator)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 254  # the e8m0 extremes: 2**-127 and 2**127
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_mxfp4(blocks, scales, dtype)  # [3, 10, 96]
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # transposed: [3, 96, 10]
        assert got.dtype == dtype and torch.equal(got, want.transpose(1, 2))
    # the nibble order and the value table, by hand: code 0x2 (1.0) low, 0xF (-6.0) high; scale 2**1
    one = dequantize_mxfp4(torch.full((1, 16), 0xF2, dtype=torch.uint8), torch.tensor([128], dtype=torch.uint8))
    assert one[:4].tolist() == [2.0, -12.0, 2.0, -12.0]


def test_dequantize_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="do not match scales"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))


def _mxfp4_twins(source: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Two copies of the tiny checkpoint whose expert matrices are MXFP4-exact random values:
    one storing them unquantized (transformers' layout), one as *_blocks/*_scales the way the
    released checkpoints do (quantization_config mxfp4)."""
    plain, quantized = tmp_path / "plain", tmp_path / "mxfp4"
    shutil.copytree(source, plain)
    shutil.copytree(source, quantized)
    tensors = load_file(plain / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, cols_out = tensors[name].shape  # x @ W: [E, in, out]
        blocks, scales = _random_mxfp4((experts, cols_out, rows_in), generator)  # stored [E, out, in]
        tensors[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    dense = {name: t for name, t in tensors.items() if f"{name}_blocks" not in packed}
    save_file({**dense, **packed}, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))
    return plain, quantized


@pytest.fixture(scope="module")
def mxfp4_twins(tiny_checkpoint, tmp_path_factory):
    return _mxfp4_twins(tiny_checkpoint("gpt_oss"), tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def _load(path, dtype=torch.float32, device="cpu"):
    return load_model(load_model_config(str(path)), str(path), device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_checkpoint_loads_like_its_unquantized_twin(mxfp4_twins, dtype):
    plain, quantized = mxfp4_twins
    want, got = _load(plain, dtype).state_dict(), _load(quantized, dtype).state_dict()
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    experts = got["model.layers.1.mlp.experts.w13"]
    assert experts.dtype == dtype and experts.abs().sum() > 0


def test_mxfp4_blocks_and_scales_in_different_shards(mxfp4_twins, tmp_path):
    plain, quantized = mxfp4_twins
    sharded = tmp_path / "sharded"
    shutil.copytree(quantized, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    shards = {"a.safetensors": {}, "b.safetensors": {}}
    for name, tensor in tensors.items():  # every scales tensor in the shard after its blocks
        shards["b.safetensors" if name.endswith("_scales") else "a.safetensors"][name] = tensor
    for file, part in shards.items():
        save_file(part, sharded / file, metadata={"format": "pt"})
    weight_map = {name: file for file, part in shards.items() for name in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    want, got = _load(plain).state_dict(), _load(sharded).state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def _logits(model, prompt: torch.Tensor) -> torch.Tensor:
    dtype = model.lm_head.weight.dtype
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.k_cache, layer.v_cache = torch.zeros(2, 8, 4, 2, 16, dtype=dtype).unbind(0)
    meta = step_metadata([(list(range(8)), 0, len(prompt))])
    with torch.no_grad(), attention_metadata(meta):
        return model.compute_logits(model(prompt, torch.arange(len(prompt))))


def test_mxfp4_checkpoint_matches_transformers_dequantized_load(mxfp4_twins):
    """transformers reads the same MXFP4 file (dequantize=True, on CPU) to the same logits: the
    layout written here is the layout it expects of the released checkpoints."""
    _, quantized = mxfp4_twins
    hf = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32, attn_implementation="eager",
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()  # fmt: skip
    skip_unless_reference(hf)
    prompt = torch.randint(1, 300, (20,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(prompt[None]).logits[0]
    torch.testing.assert_close(_logits(_load(quantized), prompt), want, atol=1e-4, rtol=1e-4)


def test_mxfp4_blocks_without_scales_is_a_clear_error(mxfp4_twins, tmp_path):
    _, quantized = mxfp4_twins
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"without their blocks/scales pair.*layers\.2\.mlp\.experts\.down_proj_b"):
        _load(broken)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mxfp4_dequantizes_on_the_gpu_like_on_the_cpu(mxfp4_twins):
    _, quantized = mxfp4_twins
    on_cpu = _load(quantized, torch.bfloat16).state_dict()
    on_gpu = _load(quantized, torch.bfloat16, "cuda").state_dict()
    for name, tensor in on_cpu.items():
        assert torch.equal(on_gpu[name].cpu(), tensor), name


# ---------------------------------------------------------------- config.json


def _hub_like_config(**overrides) -> dict:
    """The shape of openai/gpt-oss-20b's config.json (smaller numbers)."""
    base = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2,
        "sliding_window": 8, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "rope_theta": 150000, "swiglu_limit": 7.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096},
        "quantization_config": {"quant_method": "mxfp4"}, "eos_token_id": 200002, "tie_word_embeddings": False,
    }  # fmt: skip
    return {**base, **overrides}


def test_hub_config_is_normalised():
    config = model_config_from_hf(_hub_like_config())
    assert config.architecture == "gpt_oss" and config.hf_architecture == "GptOssForCausalLM"
    assert config.rope_theta == 150000 and config.rope_scaling["rope_type"] == "yarn"
    assert config.moe.num_experts == 8 and config.moe.top_k == 2 and config.moe.intermediate_size == 96
    assert config.moe.renormalize and config.attention_bias and config.o_proj_bias
    assert config.sliding_window == 8 and [config.is_sliding(i) for i in range(4)] == [True, False, True, False]


def test_missing_layer_types_alternate_like_transformers():
    hf = _hub_like_config()
    del hf["layer_types"]
    config = model_config_from_hf(hf)
    assert config.layer_types == tuple(GptOssConfig(num_hidden_layers=4).layer_types)


def test_mxfp4_is_accepted_for_gpt_oss_only():
    llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
             "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64,
             "quantization_config": {"quant_method": "mxfp4"}}  # fmt: skip
    with pytest.raises(ValueError, match="unsupported quantization method 'mxfp4'"):
        model_config_from_hf(llama)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"quantization_config": {"quant_method": "awq"}}, r"unsupported quantization method 'awq'.*mxfp4"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in 1..num_local_experts"),
        ({"partial_rotary_factor": 0.5}, "partial rotary embeddings"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_scaling type 'dynamic'"),
        ({"layer_types": ["chunked_attention"] * 4}, "unsupported layer_types"),
    ],
)
def test_unsupported_features_are_one_line_errors(overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        model_config_from_hf(_hub_like_config(**overrides))
    assert "\n" not in str(error.value)


def test_dummy_weights_in_the_checkpoint_geometry(tmp_path):
    """load_format dummy: no safetensors needed; every parameter filled (sinks and biases 0)."""
    config = hf_config("gpt_oss")
    config.architectures = ["GptOssForCausalLM"]
    (tmp_path / "config.json").write_text(config.to_json_string())
    config = load_model_config(str(tmp_path), load_format="dummy")
    model = load_model(config, str(tmp_path), "cpu", torch.float32, load_format="dummy")
    params = dict(model.named_parameters())
    assert params["model.layers.0.mlp.experts.w13"].shape == (8, 192, 64)
    assert params["model.layers.0.mlp.experts.w2"].shape == (8, 64, 96)
    assert torch.equal(params["model.layers.0.self_attn.attn.sinks"], torch.zeros(4))
    assert 0.015 < params["model.layers.3.mlp.router.weight"].std().item() < 0.025
    logits = _logits(model, torch.arange(1, 21))
    assert logits.shape == (20, 320) and torch.isfinite(logits).all()


def test_logits_match_transformers_in_bfloat16(tiny_checkpoint):
    """bf16 weights and activations stay near transformers' fp32 logits (a loose bound: the
    fp32 parity tests hold the exact promise)."""
    path = tiny_checkpoint("gpt_oss")
    prompt = torch.randint(1, 300, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = load_hf_model(path)(prompt[None]).logits[0]
    got = _logits(_load(path, torch.bfloat16), prompt)
    assert (got - want).abs().max() < 0.02
