"""Sparse mixture-of-experts MLP: a router picks `top_k` of `num_experts` expert MLPs per
token and their outputs are summed, weighted by the router's probabilities.

Expert weights are stacked: `w13` [num_experts, 2 * intermediate, hidden] holds each
expert's gate rows then up rows, `w2` [num_experts, hidden, intermediate] its down
projection; `b13`, `b2` their biases when the model has them (gpt-oss). Checkpoints that
store one tensor per expert and projection load as shards `(leaf, expert, part)` of these
(part 0 = gate, 1 = up for w13; 0 for w2).

FP8 experts hold w13 / w2 in e4m3 with `w13_scale` [E, 2I] / `w2_scale` [E, H], a scale per
expert and output row: `quantize_fp8()` makes them from loaded weights, or `make_fp8_shell()`
prepares the layer for an fp8 checkpoint, whose per-expert e4m3 tensors and scales then load as
shards of these (per-tensor and per-channel scales fill their rows; 128x128 block scales load
into `w13_scale_inv` / `w2_scale_inv` and `finalize_fp8()` requantizes them per row, as
Fp8Linear does).

`route` and `moe_reference` are the torch definitions (one matmul pair per expert that has
tokens), used on CPU and as the test reference for the fused kernel. On CUDA the experts run
as roseray_kernels.fused_moe (two grouped GEMM launches, no host syncs: CUDA-graph capturable);
the router stays torch.

Under tensor parallelism (roseray.distributed) each rank keeps every expert but 1/N of its
intermediate dimension: its share of the gate rows and of the up rows of `w13` (still gate
rows then up rows), the matching columns of `w2` and entries of `b13`; `b2` is kept on rank 0
only (zeros elsewhere). Each rank's output is then a partial sum that the model all-reduces
once per MLP, with the router replicated so that every rank routes alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from roseray.distributed import TensorParallel
from roseray.layers import fused
from roseray.layers.activation import get_activation
from roseray.layers.fp8_linear import FP8_DTYPE, per_row_scale, requantize_blocks_per_channel
from roseray.layers.tensor_parallel import split_part

# get_activation() names -> the fused kernel's activations (the same functions)
KERNEL_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                      "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu",
                      "swiglu_clamped": "swiglu_clamped"}


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert combines its gate and up halves: `name` is a get_activation() name
    applied as act(gate) * up, or "swiglu_clamped" (gpt-oss): gate and up clamped at
    `limit`, out = (up + 1) * gate * sigmoid(alpha * gate)."""

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.name == "swiglu_clamped":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return get_activation(self.name)(gate) * up


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_tokens, num_experts] logits -> (weights fp32, expert ids int64), each
    [num_tokens, top_k]: softmax over all experts in fp32, the top_k largest, rescaled to
    sum to 1 when `renormalize` (equal to a softmax over the chosen logits)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_reference(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    weights: torch.Tensor,  # [num_tokens, top_k] fp32
    ids: torch.Tensor,  # [num_tokens, top_k]
    activation: ExpertActivation,
    b13: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]
    b2: torch.Tensor | None = None,  # [num_experts, hidden]
) -> torch.Tensor:
    """The weighted sum of each token's chosen experts, one expert at a time."""
    out = torch.zeros_like(hidden)
    intermediate = w2.shape[2]
    for expert in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = F.linear(hidden[token], w13[expert], None if b13 is None else b13[expert])
        expert_out = F.linear(activation(gate_up[:, :intermediate], gate_up[:, intermediate:]), w2[expert],
                              None if b2 is None else b2[expert])  # fmt: skip
        out.index_add_(0, token, (expert_out * weights[token, slot, None]).to(hidden.dtype))
    return out


class FusedMoE(nn.Module):
    """The experts of one MoE block (the router is the model's: it owns the logits' linear).
    `intermediate_size` is the model's; under tensor parallelism `tp` this rank holds its share
    (`intermediate_size` below) and forward returns this rank's partial sum."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool = True, activation: ExpertActivation | None = None, bias: bool = False,
                 tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter_shard = split_part(intermediate_size, tp, "MoE intermediate size")
        self.rank = tp.rank
        intermediate_size = self.inter_shard.local  # this rank's, from here on
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation or ExpertActivation()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.b13 = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size), requires_grad=False) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False) if bias else None
        # fp8 experts (quantize_fp8): w13 / w2 in e4m3, one fp32 scale per expert and output row
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        self.fp8_block_size: tuple[int, int] | None = None  # while block scales await finalize_fp8()

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden_size], router_logits [num_tokens, num_experts] -> [num_tokens, hidden_size]."""
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        if fused.use_triton(hidden):
            act = self.activation
            return fused.fused_moe(hidden, self.w13, self.w2, weights, ids, KERNEL_ACTIVATIONS[act.name],
                                   self.b13, self.b2, alpha=act.alpha, limit=act.limit,
                                   w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        w13, w2 = self.w13, self.w2
        if self.w13_scale is not None:  # the reference path multiplies the dequantized weights
            w13 = w13.to(hidden.dtype) * self.w13_scale.to(hidden.dtype)[..., None]
            w2 = w2.to(hidden.dtype) * self.w2_scale.to(hidden.dtype)[..., None]
        return moe_reference(hidden, w13, w2, weights, ids, self.activation, self.b13, self.b2)

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """The experts' weights to e4m3 with a scale per expert and output row (after loading)."""
        for name in ("w13", "w2"):
            weight = getattr(self, name)
            experts, rows, cols = weight.shape
            q, scale = fused.quantize_per_channel(weight.reshape(experts * rows, cols))
            setattr(self, name, nn.Parameter(q.view(experts, rows, cols), requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale.view(experts, rows), requires_grad=False))

    def make_fp8_shell(self, block_size: tuple[int, int] | None = None) -> None:
        """Before loading an fp8 checkpoint: empty e4m3 experts with per-row scales (ones, for
        per-tensor and per-channel scales to fill), and with `block_size` the block scales."""
        experts, device = self.num_experts, self.w13.device
        for name in ("w13", "w2"):
            _, rows, cols = getattr(self, name).shape
            setattr(self, name, nn.Parameter(torch.empty(experts, rows, cols, dtype=FP8_DTYPE, device=device),
                                             requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(torch.ones(experts, rows, device=device,
                                                                   dtype=torch.float32), requires_grad=False))
        if block_size is not None:
            r, c = block_size
            inter, hidden = self.intermediate_size, self.hidden_size
            # gate and up are separate checkpoint tensors: each part has its own block rows
            self.w13_scale_inv = nn.Parameter(torch.empty(experts, 2 * -(-inter // r), -(-hidden // c),
                                                          device=device), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(experts, -(-hidden // r), -(-inter // c), device=device),
                                             requires_grad=False)
        self.fp8_block_size = block_size

    @torch.no_grad()
    def finalize_fp8(self) -> None:
        """After loading an fp8 checkpoint: block scales -> a scale per expert and row."""
        if self.fp8_block_size is None:
            return
        for name in ("w13", "w2"):
            weight, scale, scale_inv = (getattr(self, n).data for n in (name, f"{name}_scale", f"{name}_scale_inv"))
            for key in self.checkpoint_shards(name):  # one expert's gate, up or down rows at a time
                q, row_scale = requantize_blocks_per_channel(self.shard(weight, key), self.shard(scale_inv, key),
                                                             self.fp8_block_size)
                self.shard(weight, key).copy_(q)
                self.shard(scale, key).copy_(row_scale)
            delattr(self, f"{name}_scale_inv")
        self.fp8_block_size = None

    # ------------------------------------------------------------ checkpoint loading

    def checkpoint_shards(self, leaf: str) -> list[tuple[str, int, int]]:
        """One shard per expert and part: (leaf, expert, 0 = gate | 1 = up) for w13 and b13 (and
        fp8 experts' w13_scale, w13_scale_inv), (leaf, expert, 0) for w2 and b2 (w2_scale,
        w2_scale_inv). A checkpoint with stacked expert tensors yields one entry per expert too
        (a view of its tensor). Per-row scales of block-scaled experts come from finalize_fp8()."""
        if leaf.endswith("_scale") and self.fp8_block_size is not None:
            return []
        parts = 2 if leaf.startswith(("w13", "b13")) else 1
        return [(leaf, expert, part) for expert in range(self.num_experts) for part in range(parts)]

    def shard(self, param: torch.Tensor, key: tuple[str, int, int]) -> torch.Tensor:
        """One expert's slice; of w13 (and its biases and scales) the gate or up half of the rows."""
        leaf, expert, part = key
        if leaf.startswith(("w13", "b13")):
            half = param.shape[1] // 2
            return param[expert].narrow(0, part * half, half)
        return param[expert]

    def adapt_checkpoint_tensor(self, leaf: str, shard: tuple[str, int, int], tensor: torch.Tensor,
                                shape: torch.Size) -> torch.Tensor:
        """This rank's slice of one expert's checkpoint tensor: gate or up rows (w13, b13), down
        columns (w2); b2 whole on rank 0, zeros elsewhere (the all-reduce adds it once)."""
        part = self.inter_shard
        if leaf in ("w13_scale", "w2_scale"):  # fp8 checkpoints load without tensor parallelism
            return per_row_scale(tensor, shape)
        if leaf == "b2":
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if part.local == part.full:
            return tensor
        if leaf in ("w13", "b13") and tensor.shape[0] == part.full:
            return tensor.narrow(0, part.start, part.local)
        if leaf == "w2" and tensor.shape[-1] == part.full:
            return tensor.narrow(-1, part.start, part.local)
        return tensor
