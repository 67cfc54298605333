"""Fused mixture-of-experts MLP: every token's top-k experts in two grouped GEMM launches.

    hidden [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], routing weights
    and expert ids [T, k] -> sum over k of weight * w2[e] @ act(w13[e] @ hidden[t]) : [T, H]

Steps (all CUDA-graph capturable: sizes from shapes, counts read from device memory):
1. align (moe_align.py): the T*k assignments sorted by expert, each expert's run padded to a
   multiple of BLOCK_M, so each BLOCK_M-row tile of a GEMM belongs to one expert.
2. gate_up: one launch over all experts' tiles; A rows are hidden rows (token = assignment //
   k) read through the sorted indices. Each program accumulates a gate tile and the matching
   up tile (fp32), adds the biases and applies the activation in its epilogue, writing
   act(gate) * up [T*k, I] in hidden's dtype.
3. down: one launch, A rows are those activated rows (by assignment), the epilogue adds the
   bias and multiplies by the routing weight, writing [T*k, H].
4. combine: the k weighted rows of each token summed (fp32 accumulation) -> [T, H].

Tiles of padding rows (index T*k) are masked; blocks past the padded count exit at once.
Activations: "silu", "gelu_tanh", "gelu" (erf), "relu", and "swiglu_clamped" (gpt-oss:
gate <= limit, -limit <= up <= limit, (up + 1) * gate * sigmoid(alpha * gate)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .moe_align import AlignedAssignments, moe_align

ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu", "swiglu_clamped")


@dataclass(frozen=True)
class GemmTile:
    block_n: int  # output columns per program (gate_up: of each of gate and up)
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row blocks sharing one column band in launch order (L2 reuse of weight tiles)


@dataclass(frozen=True)
class MoETiles:
    block_m: int  # sorted rows per tile (also the padding unit of the align step)
    gate_up: GemmTile
    down: GemmTile


# Tiles by rows per expert (T * k / E, the expected rows of one expert's run): decode steps give
# each expert a few rows (16-row tiles, the smallest tl.dot takes; the weights dominate the
# time), prefill hundreds (64/128-row tiles for tensor-core throughput).
# UNTUNED: starting points from the usual Hopper GEMM shapes, not yet measured;
# `python -m roseray.bench kernels --moe --sweep` times the alternatives at the Qwen3-30B-A3B shape.
TILE_TABLE: tuple[tuple[float, MoETiles], ...] = (
    (8, MoETiles(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4))),
    (48, MoETiles(32, GemmTile(64, 64, 4, 4), GemmTile(64, 64, 4, 4))),
    (192, MoETiles(64, GemmTile(64, 64, 4, 4), GemmTile(128, 64, 4, 4))),
    (float("inf"), MoETiles(128, GemmTile(64, 64, 8, 4), GemmTile(128, 64, 8, 4))),
)


def choose_tiles(num_tokens: int, top_k: int, num_experts: int) -> MoETiles:
    rows_per_expert = num_tokens * top_k / num_experts
    return next(tiles for limit, tiles in TILE_TABLE if rows_per_expert <= limit)


@triton.jit
def _activate(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """act(gate) * up in fp32 (ACTIVATION indexes ACTIVATIONS)."""
    if ACTIVATION == 0:  # silu
        out = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:  # gelu, tanh approximation: 0.5 * (1 + tanh(z)) = sigmoid(2z)
        out = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    elif ACTIVATION == 2:  # gelu, erf
        out = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == 3:  # relu
        out = tl.maximum(gate, 0.0) * up
    else:  # swiglu_clamped
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    return out


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: hidden (gate_up, row = assignment // TOP_K) or activated rows (down, row = assignment)
    w_ptr,  # [E, N (gate_up: 2 * N), K]
    bias_ptr,  # [E, N (gate_up: 2 * N)] or a dummy
    out_ptr,  # [num_assignments, N]
    route_w_ptr,  # [num_assignments] fp32 routing weights (read when ROUTE_WEIGHT)
    w_scale_ptr,  # [E, N (gate_up: 2 * N)] fp32 per-row scales of fp8 weights (read when W_FP8)
    sorted_ptr, block_expert_ptr, padded_ptr,  # the align step's layout
    num_assignments, n_out, k_dim, num_blocks_m,
    stride_am, stride_we, stride_wn, stride_be, stride_om, stride_se,
    alpha, limit,
    TOP_K: tl.constexpr,  # A rows per token: top_k for gate_up, 1 for down
    GATED: tl.constexpr,  # gate_up: also the up tile (rows n_out + n of W), then the activation
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_WEIGHT: tl.constexpr,
    W_FP8: tl.constexpr,  # e4m3 weights, widened to A's dtype in registers; the row scale in the epilogue
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(n_out, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return

    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    assignment = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [M]
    row_ok = assignment < num_assignments
    a_row = (assignment // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]  # [M, K]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, N]
    up_step = n_out * stride_wn  # from a gate row of W to its up row

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(k_dim, BLOCK_K)):
        if EVEN_K:
            a_mask = row_ok[:, None]
            w_mask = n_ok[None, :]
        else:
            k_ok = offs_k < k_dim - k * BLOCK_K
            a_mask = row_ok[:, None] & k_ok[None, :]
            w_mask = n_ok[None, :] & k_ok[:, None]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if W_FP8:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_N and EVEN_K:
                w_up = tl.load(w_ptrs + up_step)
            else:
                w_up = tl.load(w_ptrs + up_step, mask=w_mask, other=0.0)
            if W_FP8:
                w_up = w_up.to(a.dtype)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if W_FP8:
        scale_row = w_scale_ptr + expert * stride_se + offs_n
        acc *= tl.load(scale_row, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(scale_row + n_out, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_be + offs_n
        acc += tl.load(bias_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + n_out, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = _activate(acc, acc_up, alpha, limit, ACTIVATION)
    if ROUTE_WEIGHT:
        acc *= tl.load(route_w_ptr + assignment, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + assignment[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def moe_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, aligned: AlignedAssignments,
             tile: GemmTile, *, top_k: int, gated: bool, activation: str = "silu", alpha: float = 1.702,
             limit: float = 7.0, route_weights: torch.Tensor | None = None,
             out: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One grouped GEMM launch over all experts' tiles: out[assignment] = a[row] @ w[e].T (+ bias);
    gated: the first half of w's rows are gates, the second ups, and out = act(gate) * up;
    route_weights [num_assignments] fp32: each output row scaled by its weight;
    w_scale [E, rows] fp32: w is e4m3 and row r of expert e stands for w[e, r] * w_scale[e, r].
    fp32 operands take at most 2 pipeline stages (their tiles need twice the shared memory)."""
    assert a.stride(-1) == 1 and w.is_contiguous(), (a.stride(), w.stride())
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    k_dim = w.shape[2]
    assert a.shape[1] == k_dim, (a.shape, w.shape)
    if out is None:
        out = torch.empty((aligned.num_assignments, n_out), dtype=a.dtype, device=a.device)
    num_pid_n = triton.cdiv(n_out, tile.block_n)
    grid = (aligned.max_blocks * num_pid_n,)
    if grid[0] == 0:
        return out
    dummy = aligned.padded_count
    _moe_gemm_kernel[grid](
        a, w, dummy if bias is None else bias, out, dummy if route_weights is None else route_weights,
        dummy if w_scale is None else w_scale,
        aligned.sorted_ids, aligned.block_expert, aligned.padded_count,
        aligned.num_assignments, n_out, k_dim, aligned.max_blocks,
        a.stride(0), w.stride(0), w.stride(1), 0 if bias is None else bias.stride(0), out.stride(0),
        0 if w_scale is None else w_scale.stride(0),
        alpha, limit,
        TOP_K=top_k, GATED=gated, ACTIVATION=ACTIVATIONS.index(activation), HAS_BIAS=bias is not None,
        ROUTE_WEIGHT=route_weights is not None, W_FP8=w_scale is not None, EVEN_K=k_dim % tile.block_k == 0,
        EVEN_N=n_out % tile.block_n == 0, DOT_PRECISION=_dot_precision(a.dtype),
        BLOCK_M=aligned.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        num_warps=tile.num_warps, num_stages=min(tile.num_stages, 2) if a.element_size() == 4 else tile.num_stages,
    )
    return out


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    routing_weights: torch.Tensor,  # [T, k] fp32
    expert_ids: torch.Tensor,  # [T, k]
    activation: str = "silu",
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    *,
    alpha: float = 1.702,
    limit: float = 7.0,
    tiles: MoETiles | None = None,
    align_method: str = "auto",
    w13_scale: torch.Tensor | None = None,  # [E, 2I] fp32: w13 and w2 are e4m3 with per-row scales
    w2_scale: torch.Tensor | None = None,  # [E, H]
) -> torch.Tensor:
    """The weighted sum of each token's top-k expert MLPs: [T, H] in hidden's dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported expert activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
    num_tokens, hidden_size = hidden.shape
    num_experts, top_k = w13.shape[0], expert_ids.shape[1]
    assert w13.shape[2] == hidden_size and w2.shape == (num_experts, hidden_size, w13.shape[1] // 2), \
        (hidden.shape, w13.shape, w2.shape)
    assert (w13_scale is None) == (w2_scale is None), "fp8 experts need both scales"
    assert w13_scale is not None or hidden.dtype == w13.dtype == w2.dtype, (hidden.dtype, w13.dtype, w2.dtype)
    if num_tokens == 0:
        return torch.empty_like(hidden)
    tiles = tiles or choose_tiles(num_tokens, top_k, num_experts)
    aligned = moe_align(expert_ids, num_experts, tiles.block_m, align_method)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    activated = moe_gemm(hidden, w13, b13, aligned, tiles.gate_up, top_k=top_k, gated=True,
                         activation=activation, alpha=alpha, limit=limit, w_scale=w13_scale)  # [T*k, I]
    expert_out = moe_gemm(activated, w2, b2, aligned, tiles.down, top_k=1, gated=False,
                          route_weights=routing_weights.reshape(-1).float(), w_scale=w2_scale)  # [T*k, H]
    if top_k == 1:
        return expert_out
    return expert_out.view(num_tokens, top_k, hidden_size).sum(dim=1)
