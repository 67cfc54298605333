"""The fused-MoE Triton path (align + two grouped GEMMs + combine) against moe_reference.

On CPU the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1 before
Triton is imported) on small shapes in fp32; on CUDA the Qwen3-30B-A3B expert shape runs in
bf16 against an fp32 reference, and a captured CUDA graph replays the layer on new inputs.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from roseray.distributed import TensorParallel
from roseray.layers.activation import _ACTIVATIONS
from roseray.layers.fused import fused_kernels
from roseray.layers.linear import WeightEntry, load_weight_entries
from roseray.layers.moe import KERNEL_ACTIVATIONS, ExpertActivation, FusedMoE, moe_reference, route
from roseray_kernels.fused_moe import GemmTile, MoETiles, fused_moe
from roseray_kernels.moe_align import align_torch, align_triton, moe_align
from tests.kernels.helpers import rel_err

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
# the reference's names for the kernel's activations
ALIGN_MODULE = importlib.import_module("roseray_kernels.moe_align")  # the package exports the function of that name
REFERENCE_NAME = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "relu": "relu",
                  "swiglu_clamped": "swiglu_clamped"}


def make_experts(num_experts, hidden, inter, bias, seed=0, scale=0.2, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * scale
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * scale
    b13 = torch.randn(num_experts, 2 * inter, generator=gen) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=gen) if bias else None
    return [None if t is None else t.to(DEVICE, dtype) for t in (w13, w2, b13, b2)]


def random_routing(num_tokens, num_experts, top_k, seed=0, experts_used=None):
    """Router weights and ids; `experts_used` limits the choice to the first that many experts."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if experts_used is not None:
        logits[:, experts_used:] = -1e9
    return route(logits.to(DEVICE), top_k, renormalize=True)


def check_layout(aligned, ids, num_experts):
    """Every assignment appears once, in a block of its expert, runs padded to block_m."""
    flat, n, bm = ids.reshape(-1).cpu(), ids.numel(), aligned.block_m
    sorted_ids = aligned.sorted_ids.cpu().long()
    padded = int(aligned.padded_count)
    assert sorted(sorted_ids[sorted_ids < n].tolist()) == list(range(n))
    assert bool((sorted_ids[padded:] == n).all())
    counts = torch.bincount(flat, minlength=num_experts)
    assert padded == int(((counts + bm - 1) // bm * bm).sum())
    for block in range(padded // bm):
        rows = sorted_ids[block * bm: (block + 1) * bm]
        assert bool((flat[rows[rows < n]] == aligned.block_expert[block].cpu()).all())


# --- align ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (1, 1, 4, 16), (1, 8, 128, 16), (7, 2, 8, 16), (33, 4, 16, 32), (64, 8, 128, 64), (100, 3, 5, 16), (3, 2, 4, 128),
    (40, 6, 60, 16),  # experts not a power of two
    (375, 8, 128, 16),  # 3000 assignments: several chunks
    (400, 8, 8, 64),  # a few experts with hundreds of assignments each
])
def test_align_triton_and_torch_agree_and_sort_by_expert(num_tokens, top_k, num_experts, block_m):
    _, ids = random_routing(num_tokens, num_experts, top_k, seed=num_tokens)
    by_triton, by_torch = align_triton(ids, num_experts, block_m), align_torch(ids, num_experts, block_m)
    check_layout(by_triton, ids, num_experts)
    for name in ("sorted_ids", "block_expert", "padded_count"):  # both stable: the same layout
        assert torch.equal(getattr(by_triton, name), getattr(by_torch, name)), name


def test_align_runs_in_assignment_order_with_empty_experts(monkeypatch):
    """Skewed routing (many experts empty, one with most assignments); a scan step and a block program
    of a few rows each, so that their loops and grids take several steps."""
    monkeypatch.setattr(ALIGN_MODULE, "SCAN_ROWS", 4)
    monkeypatch.setattr(ALIGN_MODULE, "BLOCKS_PER_PROGRAM", 4)
    gen = torch.Generator().manual_seed(7)
    num_experts, block_m = 32, 16
    ids = torch.where(torch.rand(2500, generator=gen) < 0.7, 3, torch.randint(10, 14, (2500,), generator=gen))
    ids = ids.view(-1, 5).to(DEVICE)  # 500 tokens x top-5; experts 0-2, 4-9 and 14-31 get nothing
    aligned = align_triton(ids, num_experts, block_m)
    check_layout(aligned, ids, num_experts)
    sorted_ids, flat = aligned.sorted_ids.cpu().long(), ids.reshape(-1).cpu()
    placed = sorted_ids[sorted_ids < ids.numel()]
    want = torch.cat([torch.nonzero(flat == e).flatten() for e in range(num_experts)])
    assert torch.equal(placed, want)  # by expert, in assignment order within an expert
    used = int(aligned.padded_count) // block_m
    assert bool((aligned.block_expert[used:] == num_experts - 1).all())  # unused blocks: a valid expert


@pytest.mark.parametrize("method", ["triton", "torch"])
def test_align_one_assignment(method):
    aligned = moe_align(torch.tensor([[5]], device=DEVICE), 8, 16, method)
    assert aligned.sorted_ids.cpu().tolist() == [0] + [1] * 15
    assert aligned.block_expert.cpu().tolist() == [5] and int(aligned.padded_count) == 16


# --- fused_moe against the per-expert reference (fp32: tight) -------------------------------

TILES_16 = MoETiles(16, GemmTile(16, 32, 4, 1), GemmTile(32, 16, 4, 1, group_m=2))
TILES_32 = MoETiles(32, GemmTile(32, 16, 4, 1, group_m=1), GemmTile(16, 32, 4, 1))

CASES = [  # tokens, experts, top_k, hidden, intermediate, activation, bias, tiles, align method
    (1, 4, 1, 32, 16, "silu", False, None, "auto"),
    (7, 8, 2, 48, 40, "gelu_tanh", True, TILES_16, "triton"),  # H, I not multiples of the tiles
    (33, 16, 4, 64, 32, "swiglu_clamped", True, TILES_32, "torch"),
    (12, 128, 8, 32, 16, "silu", True, TILES_16, "auto"),  # most experts get no tokens
    (64, 64, 6, 32, 32, "gelu", False, None, "torch"),
    (20, 6, 3, 16, 48, "relu", True, TILES_32, "triton"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{c[5]}-bias{int(c[6])}-{c[8]}")
def test_fused_moe_matches_reference(case):
    num_tokens, num_experts, top_k, hidden_size, inter, activation, bias, tiles, align = case
    w13, w2, b13, b2 = make_experts(num_experts, hidden_size, inter, bias, seed=num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights, ids = random_routing(num_tokens, num_experts, top_k, seed=num_tokens + 1)
    # a small limit, so that the clamps of swiglu_clamped act on some gates and ups
    reference_act = ExpertActivation(REFERENCE_NAME[activation], alpha=1.5, limit=1.0)
    want = moe_reference(hidden, w13, w2, weights, ids, reference_act, b13, b2)
    got = fused_moe(hidden, w13, w2, weights, ids, activation, b13, b2, alpha=1.5, limit=1.0, tiles=tiles,
                    align_method=align)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=["gelu_tanh-bias", "128-experts"])
def test_fp8_experts_match_the_reference_on_their_dequantized_weights(case):
    """e4m3 weights with a scale per expert and row (FusedMoE.quantize_fp8): widened in the kernel,
    scaled in its epilogue; the reference multiplies the dequantized weights."""
    num_tokens, num_experts, top_k, hidden_size, inter, activation, bias, tiles, align = case
    layer = FusedMoE(num_experts, top_k, hidden_size, inter, activation=ExpertActivation(REFERENCE_NAME[activation]),
                     bias=bias).to(DEVICE)
    w13, w2, b13, b2 = make_experts(num_experts, hidden_size, inter, bias, seed=num_tokens)
    with torch.no_grad():
        layer.w13.copy_(w13), layer.w2.copy_(w2)
        if bias:
            layer.b13.copy_(b13), layer.b2.copy_(b2)
    layer.quantize_fp8()
    assert layer.w13.dtype == torch.float8_e4m3fn and layer.w13_scale.shape == (num_experts, 2 * inter)
    dq13 = layer.w13.float() * layer.w13_scale[..., None]
    dq2 = layer.w2.float() * layer.w2_scale[..., None]
    assert rel_err(dq13, w13) < 0.04  # within e4m3's rounding of the weights
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights, ids = random_routing(num_tokens, num_experts, top_k, seed=num_tokens + 1)
    want = moe_reference(hidden, dq13, dq2, weights, ids, layer.activation, layer.b13, layer.b2)
    got = fused_moe(hidden, layer.w13, layer.w2, weights, ids, activation, layer.b13, layer.b2, tiles=tiles,
                    align_method=align, w13_scale=layer.w13_scale, w2_scale=layer.w2_scale)
    assert rel_err(got, want) < 1e-5


def test_all_tokens_on_one_expert_and_the_rest_empty():
    num_tokens, num_experts, top_k = 40, 8, 1
    w13, w2, _, _ = make_experts(num_experts, 32, 16, bias=False)
    hidden = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ids = torch.full((num_tokens, top_k), 5, dtype=torch.long, device=DEVICE)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want = moe_reference(hidden, w13, w2, weights, ids, ExpertActivation("silu"))
    assert rel_err(fused_moe(hidden, w13, w2, weights, ids, "silu", tiles=TILES_16), want) < 1e-5


def test_no_tokens():
    w13, w2, _, _ = make_experts(4, 32, 16, bias=False)
    empty = torch.empty(0, 32, device=DEVICE)
    out = fused_moe(empty, w13, w2, torch.empty(0, 2, device=DEVICE), torch.empty(0, 2, dtype=torch.long,
                                                                                     device=DEVICE))
    assert out.shape == (0, 32)


def test_every_activation_name_has_a_kernel_activation():
    assert set(_ACTIVATIONS) | {"swiglu_clamped"} == set(KERNEL_ACTIVATIONS)
    with pytest.raises(ValueError, match="unsupported expert activation"):
        fused_moe(torch.zeros(1, 32, device=DEVICE), *make_experts(4, 32, 16, bias=False)[:2],
                  torch.ones(1, 1, device=DEVICE), torch.zeros(1, 1, dtype=torch.long, device=DEVICE), "tanh")


@pytest.mark.parametrize("activation,bias", [(ExpertActivation("silu"), False),
                                             (ExpertActivation("swiglu_clamped", limit=1.0), True)])
def test_layer_takes_the_triton_path_when_fused_kernels_are_on(activation, bias):
    layer = FusedMoE(16, 4, 32, 16, activation=activation, bias=bias).to(DEVICE)
    w13, w2, b13, b2 = make_experts(16, 32, 16, bias, seed=4)
    with torch.no_grad():
        layer.w13.copy_(w13)
        layer.w2.copy_(w2)
        if bias:
            layer.b13.copy_(b13)
            layer.b2.copy_(b2)
    gen = torch.Generator().manual_seed(5)
    hidden, logits = torch.randn(9, 32, generator=gen).to(DEVICE), torch.randn(9, 16, generator=gen).to(DEVICE)
    with fused_kernels(False):
        want = layer(hidden, logits)
    with fused_kernels(True):
        got = layer(hidden, logits)
    assert rel_err(got, want) < 1e-5
    assert not torch.equal(got, torch.zeros_like(got))


# --- tensor parallelism: each rank's slice of the intermediate dimension -----------------

def sharded_layers(size, inter, bias, activation):
    """The whole layer and its `size` rank shards, all loaded through the checkpoint protocol from the
    same per-expert tensors (as a model's loader does: roseray.layers.linear.load_weight_entries)."""
    num_experts, hidden_size = 8, 32
    w13, w2, b13, b2 = [None if t is None else t.cpu() for t in make_experts(num_experts, hidden_size, inter, bias,
                                                                             seed=7)]
    layers = []
    for tp in [TensorParallel()] + [TensorParallel(rank, size) for rank in range(size)]:
        holder = nn.Module()
        holder.experts = FusedMoE(num_experts, 3, hidden_size, inter, activation=activation, bias=bias, tp=tp)
        entries = []
        for e in range(num_experts):
            for part, rows in enumerate(w13[e].split(inter)):
                entries.append(WeightEntry("w13", "experts.w13", ("w13", e, part), rows))
            entries.append(WeightEntry("w2", "experts.w2", ("w2", e, 0), w2[e]))
            if bias:
                for part, rows in enumerate(b13[e].split(inter)):
                    entries.append(WeightEntry("b13", "experts.b13", ("b13", e, part), rows))
                entries.append(WeightEntry("b2", "experts.b2", ("b2", e, 0), b2[e]))
        load_weight_entries(holder, entries)
        layers.append(holder.experts.to(DEVICE))
    return layers[0], layers[1:]


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("activation,bias", [(ExpertActivation("silu"), False),
                                             (ExpertActivation("swiglu_clamped", limit=1.0), True)])
def test_tensor_parallel_shards_sum_to_the_whole_layer(fused, activation, bias):
    """Two ranks of 20 intermediate rows each (no multiple of any tile: the kernel's masks), b2 on rank 0
    only: the ranks' outputs (their all-reduce) sum to the whole layer's."""
    whole, shards = sharded_layers(2, 40, bias, activation)
    assert [s.w13.shape[1] for s in shards] == [40, 40] and [s.w2.shape[2] for s in shards] == [20, 20]
    gen = torch.Generator().manual_seed(8)
    hidden, logits = torch.randn(9, 32, generator=gen).to(DEVICE), torch.randn(9, 8, generator=gen).to(DEVICE)
    with fused_kernels(False):
        want = whole(hidden, logits)
    with fused_kernels(fused):
        got = [shard(hidden, logits) for shard in shards]
    assert rel_err(got[0] + got[1], want) < 1e-5
    assert min(rel_err(g, want) for g in got) > 0.1  # each rank alone is a partial sum


def test_tensor_parallel_fp8_experts_quantize_each_shard_per_row():
    """Quantized after each rank keeps its slice: a shard's gate|up rows and their scales are the whole
    layer's (a scale per expert and row); down rows keep a scale over the shard's columns."""
    whole, shards = sharded_layers(2, 40, False, ExpertActivation("silu"))
    for layer in (whole, *shards):
        layer.quantize_fp8()
    for rank, shard in enumerate(shards):
        rows = torch.cat([torch.arange(20) + 20 * rank, torch.arange(20) + 40 + 20 * rank]).to(DEVICE)
        assert torch.equal(shard.w13_scale, whole.w13_scale[:, rows])
        assert torch.equal(shard.w13.view(torch.uint8), whole.w13[:, rows].view(torch.uint8))
        assert shard.w2_scale.shape == whole.w2_scale.shape


# --- CUDA: the Qwen3-30B-A3B experts in bf16, and graph capture ---------------------------

QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden=2048, inter=768)
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 8192])
def test_qwen3_30b_a3b_shape_low_precision_against_fp32_reference(num_tokens, dtype):
    if dtype == torch.float16 and num_tokens not in (7, 256):
        pytest.skip("fp16 at two sizes is enough")
    shape = QWEN3_30B_A3B
    w13, w2, _, _ = make_experts(shape["num_experts"], shape["hidden"], shape["inter"], bias=False, scale=0.02)
    hidden = torch.randn(num_tokens, shape["hidden"], device=DEVICE)
    weights, ids = random_routing(num_tokens, shape["num_experts"], shape["top_k"], seed=num_tokens)
    want = moe_reference(hidden, w13, w2, weights, ids, ExpertActivation("silu"))
    got = fused_moe(hidden.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids, "silu")
    assert got.dtype == dtype
    assert rel_err(got, want) < 2e-2
    for align in ("triton", "torch"):  # both align paths give the same bits
        assert torch.equal(got, fused_moe(hidden.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids, "silu",
                                          align_method=align))


@cuda_only
@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (8192, 8, 128, 128), (32768, 8, 128, 64), (40000, 4, 32, 64), (5000, 8, 256, 16)])
def test_align_large_steps_on_cuda(num_tokens, top_k, num_experts, block_m):
    """Prefill-sized steps: the largest chunks, more chunks than one scan step, 256 experts."""
    _, ids = random_routing(num_tokens, num_experts, top_k, seed=num_tokens)
    by_triton, by_torch = align_triton(ids, num_experts, block_m), align_torch(ids, num_experts, block_m)
    for name in ("sorted_ids", "block_expert", "padded_count"):
        assert torch.equal(getattr(by_triton, name), getattr(by_torch, name)), name


@cuda_only
def test_fp32_prefill_tiles_fit_and_match():
    """A large step takes the 128-row tiles; in fp32 they fit (fewer stages) and match tightly."""
    w13, w2, b13, b2 = make_experts(16, 256, 128, bias=True, scale=0.05)
    hidden = torch.randn(2048, 256, device=DEVICE)
    weights, ids = random_routing(2048, 16, 2)
    want = moe_reference(hidden, w13, w2, weights, ids, ExpertActivation("silu"), b13, b2)
    assert rel_err(fused_moe(hidden, w13, w2, weights, ids, "silu", b13, b2), want) < 1e-5


@cuda_only
@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu_clamped"])
def test_biased_activations_in_bf16(activation):
    w13, w2, b13, b2 = make_experts(32, 512, 256, bias=True, scale=0.05)
    hidden = torch.randn(300, 512, device=DEVICE)
    weights, ids = random_routing(300, 32, 4)
    want = moe_reference(hidden, w13, w2, weights, ids, ExpertActivation(REFERENCE_NAME[activation]), b13, b2)
    bf16 = [t.bfloat16() for t in (hidden, w13, w2)]
    got = fused_moe(bf16[0], bf16[1], bf16[2], weights, ids, activation, b13.bfloat16(), b2.bfloat16())
    assert rel_err(got, want) < 2e-2


@cuda_only
@pytest.mark.parametrize("num_tokens", [4, 64, 1024])  # 1024 x top-8: several align chunks
def test_layer_replays_in_a_cuda_graph(num_tokens):
    shape = QWEN3_30B_A3B
    layer = FusedMoE(shape["num_experts"], shape["top_k"], shape["hidden"], shape["inter"]).to(DEVICE, torch.bfloat16)
    w13, w2, _, _ = make_experts(shape["num_experts"], shape["hidden"], shape["inter"], bias=False, scale=0.02)
    with torch.no_grad():
        layer.w13.copy_(w13)
        layer.w2.copy_(w2)
    hidden = torch.randn(num_tokens, shape["hidden"], device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, shape["num_experts"], device=DEVICE, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        layer(hidden, logits)  # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = layer(hidden, logits)
    for seed in range(3):  # new inputs in the captured buffers: new routing, same graph
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        hidden.copy_(torch.randn(hidden.shape, generator=gen, device=DEVICE))
        logits.copy_(torch.randn(logits.shape, generator=gen, device=DEVICE))
        graph.replay()
        with torch.no_grad():
            eager = layer(hidden, logits)
        assert torch.equal(out, eager)
