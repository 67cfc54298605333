"""Model loading: config normalisation, presets, safetensors (single and sharded), the
local HF cache, and clear errors for everything that cannot load."""

from __future__ import annotations

import json
import shutil

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file

from roseray import LLM, SamplingParams
from roseray.models.loader import (
    load_model,
    load_model_config,
    model_config_from_hf,
    resolve_model_path,
    safetensors_files,
)
from roseray.models.presets import PRESETS
from tests.models.hf_models import make_tiny_model, set_architecture


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint):
    return tiny_checkpoint("llama")


def _load(path, dtype=torch.float32):
    return load_model(load_model_config(str(path)), str(path), "cpu", dtype)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- checkpoints


def test_sharded_checkpoint_loads_identically(tiny_llama, tmp_path):
    sharded = make_tiny_model("llama", tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 1
    whole, parts = _load(tiny_llama).state_dict(), _load(sharded).state_dict()
    assert whole.keys() == parts.keys()
    for name in whole:
        torch.testing.assert_close(parts[name], whole[name], atol=0, rtol=0)


def test_weights_come_from_the_checkpoint(tiny_llama):
    model = _load(tiny_llama)
    tensors = load_file(tiny_llama / "model.safetensors")
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(model.model.layers[1].self_attn.qkv_proj.weight[: q.shape[0]], q)
    torch.testing.assert_close(model.lm_head.weight, tensors["lm_head.weight"])  # untied in the tiny llama
    assert not model.training


def test_load_in_bfloat16_keeps_rope_tables_fp32(tiny_llama):
    model = _load(tiny_llama, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_gpt2_checkpoint_without_transformer_prefix_loads(tmp_path):
    """The original `gpt2` checkpoint names its tensors `h.0...`, `wte.weight`."""
    path = make_tiny_model("gpt2", tmp_path / "gpt2")
    reference = _load(path).state_dict()
    tensors = load_file(path / "model.safetensors")
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()}, path / "model.safetensors")
    for name, tensor in _load(path).state_dict().items():
        torch.testing.assert_close(tensor, reference[name], atol=0, rtol=0)


def test_missing_weight_is_a_clear_error(tiny_llama, tmp_path):
    path = _copy(tiny_llama, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 weight.*qkv_proj.weight\[shard 1\]"):
        _load(path)


def test_unexpected_weight_is_a_clear_error(tiny_llama, tmp_path):
    path = _copy(tiny_llama, tmp_path / "u")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.extra.weight'"):
        _load(path)


def test_shape_mismatch_is_a_clear_error(tiny_llama, tmp_path):
    path = _copy(tiny_llama, tmp_path / "s")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 80
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has shape .* expected"):
        _load(path)


# ---------------------------------------------------------------- errors before loading


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_config(str(tmp_path / "nowhere"))


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model_config(str(tmp_path))


def test_no_safetensors(tiny_llama, tmp_path):
    path = _copy(tiny_llama, tmp_path / "bin")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model_config(str(path))


def test_load_format_dummy_needs_only_config_and_tokenizer(tiny_llama, tmp_path):
    """A directory without weights builds seeded random weights in its geometry, through the
    engine as through the loader; without load_format dummy it is an error."""
    path = _copy(tiny_llama, tmp_path / "config-only")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model_config(str(path))
    config = load_model_config(str(path), load_format="dummy")
    first = load_model(config, str(path), "cpu", torch.float32, seed=3, load_format="dummy").state_dict()
    again = load_model(config, str(path), "cpu", torch.float32, seed=3, load_format="dummy").state_dict()
    real = _load(tiny_llama).state_dict()
    assert first.keys() == real.keys()
    for name, tensor in first.items():
        assert tensor.shape == real[name].shape and torch.equal(tensor, again[name]), name
    assert not torch.equal(first["model.layers.0.mlp.down_proj.weight"], real["model.layers.0.mlp.down_proj.weight"])
    llm = LLM(str(path), device="cpu", dtype="float32", load_format="dummy", num_kv_blocks=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_missing_shard_named_by_the_index(tmp_path):
    path = make_tiny_model("llama", tmp_path / "sh", max_shard_size="20KB")
    safetensors_files(path)[0].unlink()
    with pytest.raises(FileNotFoundError, match="names shard"):
        load_model_config(str(path))


def test_unsupported_architecture(tiny_llama, tmp_path):
    path = _copy(tiny_llama, tmp_path / "arch")
    set_architecture(path, "MambaForCausalLM")
    with pytest.raises(ValueError, match="unsupported model architecture 'MambaForCausalLM'.*Qwen3ForCausalLM"):
        load_model_config(str(path))


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown random preset.*random:tiny"):
        load_model_config("random:nope")


def test_hub_id_missing_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache|nor in the local"):
        load_model_config("some-org/absent-model")


def test_hub_id_in_the_local_cache_resolves_without_network(tiny_llama, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--some-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_llama, repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model_path("some-org/tiny-llama") == repo / "snapshots" / commit
    config = load_model_config("some-org/tiny-llama")
    assert config.hf_architecture == "LlamaForCausalLM"
    load_model(config, "some-org/tiny-llama", "cpu", torch.float32)


# ---------------------------------------------------------------- config normalisation


def test_gpt2_config_is_normalised(tiny_checkpoint):
    config = load_model_config(str(tiny_checkpoint("gpt2")))
    assert (config.architecture, config.hidden_size, config.num_hidden_layers) == ("gpt2", 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 4, 16)
    assert (config.intermediate_size, config.max_position_embeddings) == (256, 128)
    assert config.hidden_act == "gelu_new" and config.tie_word_embeddings


def test_qwen_flags(tiny_checkpoint):
    qwen2 = load_model_config(str(tiny_checkpoint("qwen2")))
    qwen3 = load_model_config(str(tiny_checkpoint("qwen3")))
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.hidden_size // qwen3.num_attention_heads == 16


def _llama_json(**overrides):
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64}  # fmt: skip
    return {**base, **overrides}


def test_old_style_rope_scaling_and_eos_lists():
    config = model_config_from_hf(
        _llama_json(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=[7, 8],
                    attention_bias=True, torch_dtype="bfloat16"),
        {"eos_token_id": [8, 9]},
    )  # fmt: skip
    assert config.rope_theta == 5e5 and config.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert config.eos_token_ids == [7, 8, 9]
    assert config.num_key_value_heads == 2 and config.head_dim == 8
    assert config.attention_bias and config.o_proj_bias and config.torch_dtype == torch.bfloat16


def test_new_style_rope_parameters():
    config = model_config_from_hf(_llama_json(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert config.rope_theta == 1e6 and config.rope_scaling is None


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
        model_config_from_hf(_llama_json(rope_scaling={"rope_type": "dynamic", "factor": 4.0}))


def test_mistral_sliding_window_is_per_layer():
    hf = _llama_json(architectures=["MistralForCausalLM"], sliding_window=32)
    config = model_config_from_hf(hf)
    assert config.max_position_embeddings == 64 and config.sliding_window == 32
    assert config.layer_types == ("sliding_attention",) * config.num_hidden_layers and config.is_sliding(0)
    unwindowed = model_config_from_hf({**hf, "sliding_window": None})
    assert unwindowed.sliding_window is None and not unwindowed.layer_types and not unwindowed.is_sliding(0)


def test_unsupported_quantization_method_is_named():
    with pytest.raises(ValueError, match="unsupported quantization method 'awq'"):
        model_config_from_hf(_llama_json(quantization_config={"quant_method": "awq", "bits": 4}))


# ---------------------------------------------------------------- presets


def test_tiny_preset_builds_deterministically():
    config = load_model_config("random:tiny")
    assert resolve_model_path("random:tiny") is None
    first = load_model(config, "random:tiny", "cpu", torch.float32).state_dict()
    second = load_model(config, "random:tiny", "cpu", torch.float32).state_dict()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name
    norm = first["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    std = first["model.layers.0.mlp.down_proj.weight"].std().item()
    assert 0.015 < std < 0.025


@pytest.mark.parametrize(
    "preset, geometry",
    [
        ("gpt2", (50257, 768, 12, 12, 12, 64, 3072, 1024)),
        ("qwen3-0.6b", (151936, 1024, 28, 16, 8, 128, 3072, 40960)),
        ("llama-3.2-1b", (128256, 2048, 16, 32, 8, 64, 8192, 131072)),
    ],
)
def test_big_preset_geometry(preset, geometry):
    c = load_model_config(f"random:{preset}")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.max_position_embeddings) == geometry  # fmt: skip
    assert c.tie_word_embeddings and c.eos_token_ids == [c.vocab_size - 1]


def test_preset_details():
    qwen3, llama = PRESETS["qwen3-0.6b"](), PRESETS["llama-3.2-1b"]()
    assert qwen3.qk_norm and qwen3.rope_theta == 1e6 and qwen3.rms_norm_eps == 1e-6
    assert llama.rope_theta == 5e5
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_scaling["factor"] == 32.0
