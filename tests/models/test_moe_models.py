"""Qwen3-MoE and Mixtral: config.json parsing, routing equal to transformers', both checkpoint
layouts of the experts (per-expert Hub names and transformers' stacked tensors), a variant
without renormalisation and with sparse layers by decoder_sparse_step, load_format dummy, the
offline LLM on a saved tiny directory, and one-line errors for what is unsupported. Logits of
the default tiny kinds against transformers: tests/models/test_models.py; greedy parity through
the engine: tests/engine/test_engine_parity.py."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from roseray import LLM, SamplingParams
from roseray.layers.attention import attention_metadata
from roseray.layers.moe import FusedMoE, route
from roseray.models.loader import load_model, load_model_config, model_config_from_hf
from roseray.models.mixture_of_experts import SparseMoEBlock, is_sparse_layer
from tests.models.helpers import step_metadata
from tests.models.hf_models import VOCAB_SIZE, hf_config, load_hf_model, make_tiny_model

MOE_KINDS = ("qwen3_moe", "mixtral")


def _load(path, load_format="auto"):
    config = load_model_config(str(path), load_format=load_format)
    return load_model(config, str(path), "cpu", torch.float32, load_format=load_format), config


def _keys(path) -> list[str]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return list(f.keys())


@torch.no_grad()
def _prefill_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """Logits of one prompt in one step without a KV cache (no sliding window in play)."""
    meta = step_metadata([([0] * 8, 0, len(prompt))])
    meta.slot_mapping.fill_(-1)
    with attention_metadata(meta):
        return model.compute_logits(model(prompt, torch.arange(len(prompt))))


def _prompt(length: int = 7) -> torch.Tensor:
    return torch.randint(1, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(3))


# ---------------------------------------------------------------- config.json


def test_qwen3_moe_config(tiny_checkpoint):
    config = load_model_config(str(tiny_checkpoint("qwen3_moe")))
    assert config.architecture == "qwen3_moe" and config.qk_norm and config.head_dim == 32
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (8, 4, 32, True)
    assert moe.sparse_layers == (0, 2) and config.intermediate_size == 96  # layer 1 dense (mlp_only_layers)
    assert [is_sparse_layer(config, i) for i in range(3)] == [True, False, True]
    assert not config.layer_types and config.sliding_window is None


def _qwen3_moe_json(**overrides):
    """A Hub-style Qwen3-MoE config.json (`num_experts`, as the released checkpoints spell it)."""
    hf = {k: v for k, v in hf_config("qwen3_moe").to_dict().items() if k != "num_local_experts"}
    return {**hf, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, **overrides}


def test_qwen3_moe_hub_config_spellings():
    config = model_config_from_hf(_qwen3_moe_json(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[]))
    assert config.moe.num_experts == 8 and not config.moe.renormalize and config.moe.sparse_layers == (1,)
    every = model_config_from_hf(_qwen3_moe_json(mlp_only_layers=[]))
    assert every.moe.sparse_layers is None and all(is_sparse_layer(every, i) for i in range(3))
    windowed = model_config_from_hf(_qwen3_moe_json(use_sliding_window=True, sliding_window=16))
    assert windowed.sliding_window == 16 and windowed.layer_types == ("sliding_attention",) * 3
    unwindowed = model_config_from_hf(_qwen3_moe_json(use_sliding_window=False, sliding_window=16))
    assert unwindowed.sliding_window is None and not unwindowed.layer_types


def _mixtral_json(**overrides):
    return {**hf_config("mixtral").to_dict(), "architectures": ["MixtralForCausalLM"], **overrides}


def test_mixtral_config(tiny_checkpoint):
    config = load_model_config(str(tiny_checkpoint("mixtral")))
    assert config.architecture == "mixtral" and not config.qk_norm and config.head_dim == 16
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (8, 2, 32, True)
    assert moe.sparse_layers is None
    assert config.sliding_window == 8 and config.layer_types == ("sliding_attention",) * 2


@pytest.mark.parametrize(
    "kind, overrides, message",
    [
        ("qwen3_moe", {"shared_expert_intermediate_size": 64},
         "Qwen3MoeForCausalLM with shared experts (shared_expert_intermediate_size) is unsupported"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "routes each token to 9 of 8 experts"),
        ("qwen3_moe", {"mlp_bias": True}, "Qwen3MoeForCausalLM with mlp_bias=true is unsupported"),
        ("mixtral", {"num_experts_per_tok": 0}, "routes each token to 0 of 8 experts"),
        ("mixtral", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "unsupported rope_scaling type"),
        ("mixtral", {"hidden_act": "relu2"}, "unsupported activation 'relu2'"),
    ],
)  # fmt: skip
def test_unsupported_features_are_one_line_errors(kind, overrides, message):
    hf = _qwen3_moe_json() if kind == "qwen3_moe" else _mixtral_json()
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        model_config_from_hf({**hf, **overrides})
    assert "\n" not in str(error.value)


def test_mixtral_router_jitter_is_ignored():
    hf = _mixtral_json()
    jittered, plain = model_config_from_hf({**hf, "router_jitter_noise": 0.1}), model_config_from_hf(hf)
    assert dataclasses.replace(jittered, hf_config={}) == dataclasses.replace(plain, hf_config={})


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize("router, renormalize", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_route_equals_transformers_router(router, renormalize):
    """roseray.layers.moe.route picks the experts and weights transformers' routers do
    (Qwen3-MoE without norm_topk_prob: softmax over all experts, top-k, no renormalisation)."""
    config = hf_config(router)
    config.norm_topk_prob = renormalize
    module = (Qwen3MoeTopKRouter if router == "qwen3_moe" else MixtralTopKRouter)(config)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.1)
        hidden = torch.randn(50, config.hidden_size, generator=generator)
        logits, want_weights, want_ids = module(hidden)
    weights, ids = route(F.linear(hidden, module.weight), config.num_experts_per_tok, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float(), atol=0, rtol=0)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(50)) if renormalize else bool((sums < 0.99).all())


# ---------------------------------------------------------------- checkpoint layouts


def test_hub_checkpoints_store_one_tensor_per_expert(tiny_checkpoint):
    """transformers 5 saves the experts in the Hub's per-expert names by default (what the
    tiny checkpoints of the other tests load)."""
    qwen_keys, mixtral_keys = _keys(tiny_checkpoint("qwen3_moe")), _keys(tiny_checkpoint("mixtral"))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in qwen_keys
    assert "model.layers.1.mlp.gate_proj.weight" in qwen_keys  # the dense layer
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in mixtral_keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in mixtral_keys


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_stacked_expert_checkpoint_loads_identically(kind, tiny_checkpoint, tmp_path):
    """transformers' own layout (save_original_format=False): mlp.experts.gate_up_proj
    [experts, 2 * intermediate, hidden] and mlp.experts.down_proj, stacked per layer."""
    stacked = make_tiny_model(kind, tmp_path / "stacked", save_original_format=False)
    keys = _keys(stacked)
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys and "model.layers.0.mlp.experts.down_proj" in keys
    assert not any(".experts.0." in key for key in keys)
    per_expert, _ = _load(tiny_checkpoint(kind))
    from_stacked, _ = _load(stacked)
    want, got = per_expert.state_dict(), from_stacked.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    experts = from_stacked.model.layers[0].mlp.experts
    assert isinstance(experts, FusedMoE) and not torch.equal(experts.w13[0, :32], experts.w13[0, 32:])


def test_stacked_experts_of_the_wrong_count_are_a_clear_error(tmp_path):
    path = make_tiny_model("qwen3_moe", tmp_path / "bad", save_original_format=False)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj"] = tensors["model.layers.0.mlp.experts.down_proj"][:6].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.down_proj' has shape \(6, 64, 32\), expected "
                                         r"\[8, \.\.\.\]"):  # fmt: skip
        _load(path)


def test_unnormalised_top_k_with_sparse_step_matches_hf(tmp_path):
    """norm_topk_prob=False (the top-k probabilities as they are) and decoder_sparse_step=2
    (MoE on layers 1, 3; dense MLPs on 0, 2)."""
    config = hf_config("qwen3_moe")
    config.norm_topk_prob, config.decoder_sparse_step, config.mlp_only_layers = False, 2, []
    config.num_hidden_layers = 4
    path = make_tiny_model("qwen3_moe", tmp_path / "variant", config=config)
    model, roseray_config = _load(path)
    assert roseray_config.moe.sparse_layers == (1, 3) and not roseray_config.moe.renormalize
    assert [isinstance(layer.mlp, SparseMoEBlock) for layer in model.model.layers] == [False, True, False, True]
    prompt = _prompt()
    with torch.no_grad():
        want = load_hf_model(path)(prompt[None]).logits[0]
    torch.testing.assert_close(_prefill_logits(model, prompt), want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- dummy weights and the offline LLM


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_load_format_dummy_builds_and_runs(kind, tiny_checkpoint, tmp_path):
    """config.json and tokenizer files only: seeded random weights in the checkpoint's geometry."""
    path = tmp_path / "config-only"
    shutil.copytree(tiny_checkpoint(kind), path, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model_config(str(path))
    model, config = _load(path, load_format="dummy")
    experts = model.model.layers[0].mlp.experts
    assert experts.w13.shape == (8, 64, 64) and experts.w2.shape == (8, 64, 32)
    assert 0.015 < experts.w13.std().item() < 0.025
    logits = _prefill_logits(model, _prompt())
    assert logits.shape == (7, VOCAB_SIZE) and torch.isfinite(logits).all()
    again, _ = _load(path, load_format="dummy")
    assert torch.equal(_prefill_logits(again, _prompt()), logits)  # seeded
    llm = LLM(str(path), device="cpu", load_format="dummy", block_size=4)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_llm_runs_a_saved_tiny_directory(kind, tiny_checkpoint):
    path = tiny_checkpoint(kind)
    assert json.loads((path / "config.json").read_text())["architectures"] == [
        {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[kind]
    ]
    llm = LLM(str(path), device="cpu")
    out = llm.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 5 and isinstance(out[0].outputs[0].text, str)
