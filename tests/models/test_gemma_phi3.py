"""Gemma 2, Gemma 3 and Phi-3 beyond the logit and greedy parity of test_models.py and
test_engine_parity.py: the forms of their config.json, Gemma's (1 + w) norms, LongRoPE against
transformers' own, random (dummy) weights in their geometry, and one-line errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from roseray import LLM, SamplingParams
from roseray.layers.attention import Attention, attention_metadata
from roseray.layers.norms import RMSNorm
from roseray.layers.rotary import RotaryEmbedding
from roseray.models.gemma import gemma3_rope
from roseray.models.loader import load_model, load_model_config, model_config_from_hf
from tests.models.helpers import step_metadata

NEW_KINDS = ["gemma2", "gemma3", "phi3", "phi3-longrope"]
SLIDING, FULL = "sliding_attention", "full_attention"


def _load(path, **kwargs):
    config = load_model_config(str(path), **kwargs)
    return load_model(config, str(path), "cpu", torch.float32, **kwargs), config


def _gemma_json(architecture="Gemma2ForCausalLM", **overrides):
    base = {"architectures": [architecture], "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32,
            "max_position_embeddings": 64, "sliding_window": 8, "query_pre_attn_scalar": 8}  # fmt: skip
    return {**base, **overrides}


def _phi3_json(**overrides):
    base = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 64}  # fmt: skip
    return {**base, **overrides}


# ---------------------------------------------------------------- config.json


def test_gemma2_config_without_layer_types_alternates_local_and_global_layers():
    config = model_config_from_hf(_gemma_json(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                              hidden_act="gelu_pytorch_tanh", rope_theta=10000.0))  # fmt: skip
    assert config.architecture == "gemma" and config.layer_types == (SLIDING, FULL) * 2
    assert config.sliding_window == 8 and config.is_sliding(0) and not config.is_sliding(1)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh" and not config.qk_norm
    assert config.head_dim == 8 and config.rope_scaling is None


def test_gemma3_older_and_newer_config_forms_agree():
    older = _gemma_json("Gemma3ForCausalLM", num_hidden_layers=6, sliding_window_pattern=3, rope_theta=1e6,
                        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                        attn_logit_softcapping=50.0)  # fmt: skip
    newer = _gemma_json("Gemma3ForCausalLM", num_hidden_layers=6, layer_types=[SLIDING, SLIDING, FULL] * 2,
                        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                                         FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})  # fmt: skip
    for hf in (older, newer):
        config = model_config_from_hf(hf)
        assert config.layer_types == (SLIDING, SLIDING, FULL) * 2 and config.qk_norm
        assert config.rope_theta == 1e6 and config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        assert gemma3_rope(hf)[1] == (1e4, None)  # the local layers' RoPE
        assert config.attn_logit_softcap is None  # transformers' Gemma 3 applies none
    defaults = _gemma_json("Gemma3ForCausalLM", num_hidden_layers=6)  # transformers' defaults fill in
    assert gemma3_rope(defaults) == ((1e6, None), (1e4, None))
    assert model_config_from_hf(defaults).layer_types == (SLIDING,) * 5 + (FULL,)


def test_phi3_config_longrope_aliases_and_window():
    factors = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    config = model_config_from_hf(_phi3_json(rope_scaling={"type": "su", **factors}, rope_theta=1e4,
                                             original_max_position_embeddings=16, sliding_window=8))  # fmt: skip
    assert config.architecture == "phi3" and config.head_dim == 8 and not config.tie_word_embeddings
    assert config.rope_scaling == {**factors, "rope_type": "longrope", "original_max_position_embeddings": 16}
    assert config.sliding_window == 8 and config.layer_types == (SLIDING, SLIDING)
    wide = model_config_from_hf(_phi3_json(sliding_window=262144))  # Phi-3-mini-128k: wider than any sequence
    assert wide.sliding_window is None and not wide.layer_types and wide.rope_scaling is None


@pytest.mark.parametrize("hf, message", [
    (_gemma_json(use_bidirectional_attention=True), "Gemma2ForCausalLM with use_bidirectional_attention=true"),
    (_gemma_json("Gemma3ForCausalLM", rope_parameters={SLIDING: {"rope_type": "default"},
                                                       FULL: {"rope_type": "dynamic", "factor": 2.0}}),
     "unsupported rope_scaling type 'dynamic'"),
    (_gemma_json(layer_types=[SLIDING, FULL]), "layer_types names 2 layers; the model has 4"),
    (_gemma_json(sliding_window=None), "sliding_attention layers but sliding_window is not set"),
    (_phi3_json(partial_rotary_factor=0.75), "partial rotary embeddings"),
    (_phi3_json(rope_scaling={"type": "longrope", "short_factor": [1.0] * 4}), "longrope rope_scaling without "
                                                                                "long_factor"),
    (_phi3_json(hidden_act="swiglu_oai"), "unsupported activation 'swiglu_oai'"),
])  # fmt: skip
def test_unsupported_features_are_one_line_errors(hf, message):
    with pytest.raises(ValueError, match=message) as error:
        model_config_from_hf(hf)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------- LongRoPE


@pytest.mark.parametrize("original, attention_factor", [(32, None), (128, 1.25)], ids=["long", "short"])
def test_longrope_table_matches_transformers(original, attention_factor):
    """max_position_embeddings 128: past an original context of 32 the long factors apply (with
    the attention factor from 128 / 32), at 128 the short ones (with a given attention factor)."""
    generator = torch.Generator().manual_seed(0)
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": (1 + torch.rand(8, generator=generator)
              ).tolist(), "long_factor": (1 + 4 * torch.rand(8, generator=generator)).tolist()}  # fmt: skip
    if attention_factor is not None:
        params["attention_factor"] = attention_factor
    hf_config = Phi3Config(vocab_size=32, hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                           intermediate_size=32, max_position_embeddings=128,
                           original_max_position_embeddings=original, rope_parameters=params)  # fmt: skip
    long = original < 128
    inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=original + 1 if long else None)
    freqs = torch.outer(torch.arange(128, dtype=torch.float32), inv_freq)
    expected = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale

    config = model_config_from_hf({**hf_config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    table = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                            config.rope_scaling).cos_sin_cache  # fmt: skip
    assert scale != 1.0
    torch.testing.assert_close(table, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- weights


def test_gemma_norms_hold_one_plus_the_checkpoint_weight(tiny_checkpoint):
    path = tiny_checkpoint("gemma3")
    checkpoint = load_file(path / "model.safetensors")
    params = dict(_load(path)[0].named_parameters())
    names = [name for name in checkpoint if name.endswith("norm.weight")]
    assert {"model.norm.weight", "model.layers.3.self_attn.k_norm.weight",
            "model.layers.0.pre_feedforward_layernorm.weight"} <= set(names)  # fmt: skip
    for name in names:
        torch.testing.assert_close(params[name], checkpoint[name] + 1.0, atol=0, rtol=0)
    model = _load(path)[0]
    layers = model.model.layers
    assert layers[0].self_attn.rotary_emb is layers[2].self_attn.rotary_emb is model.model.local_rotary_emb
    assert layers[1].self_attn.rotary_emb is model.model.rotary_emb
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [8, None, 8, 8]


def test_phi3_fused_checkpoint_tensors_of_the_wrong_size_are_a_clear_error(tiny_checkpoint, tmp_path):
    path = shutil.copytree(tiny_checkpoint("phi3"), tmp_path / "phi3")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"weight '{name}' has shape \\(112, 64\\), expected 128 rows"):
        _load(path)


@pytest.mark.parametrize("kind", ["gemma2", "phi3"])
def test_unexpected_checkpoint_tensor_is_a_clear_error(kind, tiny_checkpoint, tmp_path):
    path = shutil.copytree(tiny_checkpoint(kind), tmp_path / kind)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(4)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.extra.weight'"):
        _load(path)


def _dummy_dir(src, dst):
    """The checkpoint's config.json and tokenizer files, without weights."""
    dst.mkdir()
    for file in src.iterdir():
        if not file.name.endswith(".safetensors"):
            shutil.copy(file, dst / file.name)
    return dst


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_dummy_weights_build_and_run(kind, tiny_checkpoint, tmp_path):
    path = _dummy_dir(tiny_checkpoint(kind), tmp_path / kind)
    model, config = _load(path, load_format="dummy")
    for module in model.modules():
        if isinstance(module, RMSNorm):  # (1 + w) with w = 0 for Gemma
            assert torch.equal(module.weight, torch.ones_like(module.weight))
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    for layer in layers:
        shape = (8, 4, config.num_key_value_heads, config.head_dim)
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    ids = torch.randint(1, config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), attention_metadata(step_metadata([(list(range(5)), 0, 20)])):
        logits = model.compute_logits(model(ids, torch.arange(20)))
    assert logits.shape == (20, config.vocab_size) and torch.isfinite(logits).all()
    if config.final_logit_softcap is not None:
        assert logits.abs().max() < config.final_logit_softcap
    llm = LLM(str(path), load_format="dummy", device="cpu", dtype="float32", block_size=4, num_kv_blocks=32)
    out = llm.generate([[5, 6, 7] * 5], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 4
