"""Tensor parallelism on CPU: two processes joined over gloo load a tiny checkpoint (the Llama
family, the MoE families, Gemma, Phi-3) through roseray's loader, each keeping its shard, and
their forward gives the logits of the whole model in one process (fp32; the all-reduce only
reorders sums)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from roseray.distributed import TensorParallel, init_tensor_parallel, shutdown_tensor_parallel, tensor_parallel
from roseray.layers.tensor_parallel import kv_head_part
from roseray.models.loader import load_model, load_model_config
from tests.distributed.prefill import prefill_logits, prompts
from tests.models.hf_models import make_tiny_model
from tests.models.test_gpt_oss import _mxfp4_twins

SIZE = 2


def _rank(rank: int, init: str, paths: list[str], out: str, load_args: dict) -> None:
    init_tensor_parallel(rank, SIZE, init, "gloo")
    try:
        for index, path in enumerate(paths):
            torch.save(prefill_logits(path, prompts(), **load_args), f"{out}.{index}.{rank}")
    finally:
        shutdown_tensor_parallel()


def tensor_parallel_logits(path, tmp_path, **load_args) -> list[torch.Tensor]:
    return tensor_parallel_logits_of([path], tmp_path, **load_args)[0]


def tensor_parallel_logits_of(paths, tmp_path, **load_args) -> list[list[torch.Tensor]]:
    """Each checkpoint's logits on every rank (one pair of processes loads them in turn)."""
    init = f"file://{tmp_path / 'rendezvous'}"
    out = tmp_path / "logits"
    mp.spawn(_rank, args=(init, [str(p) for p in paths], str(out), load_args), nprocs=SIZE, join=True)
    return [[torch.load(f"{out}.{index}.{rank}") for rank in range(SIZE)] for index in range(len(paths))]


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),  # GQA: one of the two KV heads per rank, untied lm_head
    ("qwen2", {}),  # q/k/v biases, tied embeddings
    ("qwen3", {}),  # q/k norms, head_dim 32
    ("llama", {"num_key_value_heads": 1}),  # fewer KV heads than ranks: the head is replicated
])
def test_two_ranks_give_the_whole_models_logits(kind, overrides, tmp_path):
    path = make_tiny_model(kind, tmp_path / kind, **overrides)
    want = prefill_logits(path, prompts())
    got = tensor_parallel_logits(path, tmp_path)
    for logits in got:  # every rank has all of the vocabulary's logits
        assert logits.shape == want.shape
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))


# Every other family that shards, loaded in turn by one pair of ranks. The cache-less forward leaves out
# windows, softcaps and sinks: tests/distributed/test_tensor_parallel_engine.py runs those through the engine.
OTHER_FAMILIES = (
    "qwen3_moe",  # experts split on their intermediate dimension (16 per rank), a dense layer beside
    "mixtral",
    "gpt_oss",  # expert biases (b2 on rank 0), sinks split with the heads, the router's bias
    "gemma2",  # four norms, a tied vocabulary-parallel embedding scaled by sqrt(hidden), logit softcap
    "gemma3",
    "phi3",  # fused qkv_proj / gate_up_proj checkpoint tensors cut per part, then per rank
)


def test_two_ranks_give_the_whole_models_logits_for_the_moe_gemma_and_phi3_families(tmp_path, tiny_checkpoint):
    """... and gpt-oss's MXFP4 experts, sliced after dequantization."""
    mxfp4 = _mxfp4_twins(tiny_checkpoint("gpt_oss"), tmp_path / "gpt_oss_mxfp4")[1]
    kinds, paths = (*OTHER_FAMILIES, "gpt_oss MXFP4"), [*(tiny_checkpoint(kind) for kind in OTHER_FAMILIES), mxfp4]
    for kind, path, got in zip(kinds, paths, tensor_parallel_logits_of(paths, tmp_path)):
        want = prefill_logits(path, prompts())
        for logits in got:
            assert logits.shape == want.shape, kind
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{kind}: {m}")
            assert torch.equal(logits.argmax(-1), want.argmax(-1)), kind


def test_moe_fp8_quantization_at_load_shards_per_rank(tmp_path, tiny_checkpoint):
    """Experts quantized after each rank keeps its slice (a scale per expert and row of the shard:
    tests/kernels/test_fused_moe.py): TP=2 in fp8 is as close to the fp32 model as TP=1 in fp8."""
    path = tiny_checkpoint("qwen3_moe")
    exact = prefill_logits(path, prompts())
    one = prefill_logits(path, prompts(), quantization="fp8")
    error = lambda logits: float((logits - exact).norm() / exact.norm())  # noqa: E731
    for logits in tensor_parallel_logits(path, tmp_path, quantization="fp8"):
        assert error(logits) < 1.25 * error(one), (error(logits), error(one))


def test_fp8_quantization_at_load_shards_too(tmp_path):
    path = make_tiny_model("llama", tmp_path / "llama")
    want = prefill_logits(path, prompts(), quantization="fp8")
    for logits in tensor_parallel_logits(path, tmp_path, quantization="fp8"):
        # per-channel scales are per output row, so column shards quantize alike; row shards differ a little
        assert float((logits - want).norm() / want.norm()) < 0.02


def test_kv_heads_split_or_replicate():
    assert kv_head_part(8, 128, TensorParallel(1, 2)).start == 4 * 128
    replicated = [kv_head_part(2, 64, TensorParallel(r, 4)) for r in range(4)]
    assert [p.start for p in replicated] == [0, 0, 64, 64] and {p.local for p in replicated} == {64}
    with pytest.raises(ValueError, match="not a multiple of the model's 3 KV heads"):
        kv_head_part(3, 64, TensorParallel(0, 4))
    with pytest.raises(ValueError, match="does not divide the model's attention heads"):
        TensorParallel(0, 3).split(4 * 64, "attention heads")


def _refusing_rank(rank: int, init: str, path: str, out: str, load_args: dict) -> None:
    init_tensor_parallel(rank, SIZE, init, "gloo")
    try:
        load_model(load_model_config(path), path, "cpu", torch.float32)
    except ValueError as exc:
        with open(f"{out}.{rank}", "w") as f:
            f.write(str(exc))
    finally:
        shutdown_tensor_parallel()


def test_models_that_do_not_shard_are_refused_in_one_line(tmp_path):
    path = make_tiny_model("gpt2", tmp_path / "gpt2")
    out = tmp_path / "error"
    mp.spawn(_refusing_rank, args=(f"file://{tmp_path / 'rendezvous'}", str(path), str(out), {}), nprocs=SIZE)
    for rank in range(SIZE):
        assert (tmp_path / f"error.{rank}").read_text().startswith(
            "tensor_parallel_size 2: GPT2LMHeadModel does not shard yet")


def test_a_process_outside_any_group_is_rank_0_of_1():
    assert tensor_parallel() == TensorParallel(0, 1, None)
