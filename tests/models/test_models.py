"""Parity of roseray's models with Hugging Face transformers on tiny random checkpoints:
the same logits (fp32) for a prefill without a cache and for prefill chunks + decode steps
through the paged KV cache (block_size 4, non-contiguous blocks, two sequences per step)."""

from __future__ import annotations

import pytest
import torch
import transformers

from roseray.layers.attention import Attention, attention_metadata
from roseray.models.loader import load_model, load_model_config
from tests.models.helpers import step_metadata
from tests.models.hf_models import KINDS, VOCAB_SIZE, load_hf_model

BLOCK_SIZE = 4
ATOL = 1e-4


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tiny_checkpoint):
    """(kind, path, HF logits of two prompts) for each kind."""
    kind = request.param
    path = tiny_checkpoint(kind)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB_SIZE, (length,), generator=generator) for length in (11, 7)]
    hf_model = load_hf_model(path)
    with torch.no_grad():
        expected = [hf_model(prompt[None]).logits[0].float() for prompt in prompts]  # each [len, vocab]
    return kind, path, prompts, expected


def _load(path):
    config = load_model_config(str(path))
    return load_model(config, str(path), "cpu", torch.float32), config


def _bind_kv_cache(model, config, num_blocks: int) -> int:
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    for layer in layers:
        shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    return len(layers)


@torch.no_grad()
def _run(model, prompts, spans, meta) -> list[torch.Tensor]:
    """Run one step over `spans` [(start, end)] of each prompt; return each span's logits."""
    input_ids = torch.cat([prompt[start:end] for prompt, (start, end) in zip(prompts, spans)])
    positions = torch.cat([torch.arange(start, end) for start, end in spans])
    with attention_metadata(meta):
        logits = model.compute_logits(model(input_ids, positions))  # [num_tokens, vocab]
    assert logits.dtype == torch.float32
    return list(logits.split([end - start for start, end in spans]))


def test_prefill_without_cache_matches_hf(checkpoint):
    kind, path, prompts, expected = checkpoint
    model, _ = _load(path)
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    if any(layer.sliding_window or layer.sinks is not None or layer.softcap for layer in layers):
        pytest.skip("the cache-less forward (the memory-profiling run, outputs discarded) applies no sliding window, "
                    "sinks or softcap; the paged test covers them")
    spans = [(0, len(prompt)) for prompt in prompts]
    meta = step_metadata([([0] * 3, 0, len(prompt)) for prompt in prompts])
    meta.slot_mapping.fill_(-1)  # no cache: nothing is written
    for got, want in zip(_run(model, prompts, spans, meta), expected):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4, msg=lambda m: f"{kind}: {m}")


def test_paged_prefill_chunks_and_decode_match_hf(checkpoint):
    kind, path, prompts, expected = checkpoint
    model, config = _load(path)
    assert _bind_kv_cache(model, config, num_blocks=12) == config.num_hidden_layers
    tables = [[5, 0, 9], [2, 7]]  # non-contiguous blocks; prompt 0 spans 3 blocks, prompt 1 spans 2
    # (prompt 0 span, prompt 1 span) per step: prefill, a chunk beside a decode, then decodes.
    schedule = [((0, 6), (0, 3)), ((6, 8), (3, 4)), ((8, 9), (4, 5)), ((9, 10), (5, 6)), ((10, 11), (6, 7))]
    for step, spans in enumerate(schedule):
        meta = step_metadata([(table, start, end - start) for table, (start, end) in zip(tables, spans)])
        for seq, (got, (start, end)) in enumerate(zip(_run(model, prompts, spans, meta), spans)):
            torch.testing.assert_close(
                got, expected[seq][start:end], atol=ATOL, rtol=1e-4,
                msg=lambda m: f"{kind} step {step} seq {seq}: {m}",
            )  # fmt: skip


def test_odd_vocab_gpt2_matches_hf_through_padded_lm_head(tmp_path):
    """GPT-2 with vocab 317: lm_head multiplies by 320 padded rows; the logits are the first 317."""
    hf_config = transformers.GPT2Config(vocab_size=317, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(hf_config).eval()
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model, config = _load(tmp_path)
    assert config.vocab_size == 317
    wte = model.transformer.wte.weight
    assert wte.untyped_storage().nbytes() == 320 * 64 * 4  # padded storage behind the [317, 64] embedding
    prompt = torch.randint(0, 317, (9,), generator=torch.Generator().manual_seed(2))
    meta = step_metadata([([0] * 3, 0, 9)])
    meta.slot_mapping.fill_(-1)
    got = _run(model, [prompt], [(0, 9)], meta)[0]
    with torch.no_grad():
        want = hf_model(prompt[None]).logits[0].float()
    assert got.shape == (9, 317)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_random_tiny_preset_runs():
    config = load_model_config("random:tiny")
    model = load_model(config, "random:tiny", "cpu", torch.float32)
    again = load_model(config, "random:tiny", "cpu", torch.float32)
    meta = step_metadata([([0], 0, 3)])
    meta.slot_mapping.fill_(-1)
    ids = torch.tensor([1, 2, 3])
    logits = _run(model, [ids], [(0, 3)], meta)[0]
    assert logits.shape == (3, config.vocab_size) and torch.isfinite(logits).all()
    torch.testing.assert_close(logits, _run(again, [ids], [(0, 3)], meta)[0], atol=0, rtol=0)  # seeded init
