"""The add+RMSNorm that takes a row-parallel block's all-reduce (RMSNorm.all_reduce_add, which the Llama
decoder layers use under tensor parallelism): on one rank exactly forward(x, residual); over gloo exactly
the all-reduce and then forward; the fused kernel only with the triton method and on rows it takes; and,
under Triton's interpreter with two ranks as processes, whole tiny models whose every add+RMSNorm after a
block runs the fused kernel give the logits of the plain path (interpreted_decoder_layer.py)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from roseray import distributed
from roseray.distributed import TensorParallel, all_reduce, init_tensor_parallel, shutdown_tensor_parallel
from roseray.layers.norms import RMSNorm
from roseray.symmetric_all_reduce import SymmetricAllReduce
from roseray.triton_all_reduce import TritonAllReduce
from roseray_kernels.fused_norm import rmsnorm_reference
from tests.distributed.test_triton_all_reduce import INTERPRETED_TIMEOUT_S, cpu_peers, run_interpreted

HIDDEN = 256
INTERPRETED_FAMILIES = ("llama", "qwen3_moe", "gpt_oss")  # the dense MLP, the MoE block beside it, gpt-oss's MoE


def random_norm(dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(HIDDEN, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(HIDDEN))
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_one_rank_it_is_the_add_and_norm_bit_for_bit(dtype):
    torch.manual_seed(0)
    norm, x, residual = random_norm(dtype), torch.randn(7, HIDDEN).to(dtype), torch.randn(7, HIDDEN).to(dtype)
    got, want = norm.all_reduce_add(x.clone(), residual), norm(x.clone(), residual)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class FakeTritonAllReduce(TritonAllReduce):
    """The triton method's host side; the sums are as if every rank held this rank's x."""

    def __init__(self, fuses: bool) -> None:  # not TritonAllReduce's: no GPU, no symmetric memory
        self.peers, self.fuses, self.calls = cpu_peers(), fuses, []
        self.abort_flag = torch.zeros(1, dtype=torch.int32)

    def takes(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        return 2 * x

    def takes_rows(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.fuses and super().takes_rows(x, residual, weight)

    def add_rmsnorm(self, x, residual, weight, eps):
        self.calls.append("fused")
        return rmsnorm_reference(2 * x, weight, eps, residual)


def two_ranks(monkeypatch, reduce) -> None:
    monkeypatch.setattr(distributed, "_CURRENT", TensorParallel(rank=0, size=2))
    monkeypatch.setattr(distributed, "_SYMMETRIC", reduce)
    monkeypatch.setattr(distributed, "_aborted", False)


def test_the_fused_kernel_runs_for_the_triton_method_on_rows_it_takes(monkeypatch):
    torch.manual_seed(1)
    norm, x, residual = random_norm(torch.float32), torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    want = norm(2 * x, residual)
    for fuses, calls in ((True, ["fused"]), (False, ["all_reduce"])):
        reduce = FakeTritonAllReduce(fuses)
        two_ranks(monkeypatch, reduce)
        got = norm.all_reduce_add(x.clone(), residual)
        assert reduce.calls == calls
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    reduce = FakeTritonAllReduce(True)
    two_ranks(monkeypatch, reduce)
    norm.all_reduce_add(x.clone(), residual.bfloat16())  # a residual of another dtype: not the fused kernel's
    assert reduce.calls == ["all_reduce"]


def test_no_other_method_fuses_and_an_aborted_group_raises(monkeypatch):
    x, residual, weight = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN), torch.ones(HIDDEN)
    two_ranks(monkeypatch, SymmetricAllReduce.__new__(SymmetricAllReduce))  # torch's symmetric memory
    assert distributed.all_reduce_add_rmsnorm(x, residual, weight, 1e-6) is None
    two_ranks(monkeypatch, None)  # NCCL or gloo
    assert distributed.all_reduce_add_rmsnorm(x, residual, weight, 1e-6) is None
    two_ranks(monkeypatch, FakeTritonAllReduce(True))
    monkeypatch.setattr(distributed, "_aborted", True)
    with pytest.raises(RuntimeError, match="aborted"):
        distributed.all_reduce_add_rmsnorm(x, residual, weight, 1e-6)


def _gloo_rank(rank: int, init: str) -> None:
    init_tensor_parallel(rank, 2, init, "gloo")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(3)  # the same weight and residual on both ranks
            norm, residual = random_norm(dtype), torch.randn(9, HIDDEN).to(dtype)
            partials = [torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(r)).to(dtype) for r in (0, 1)]
            normed, summed = norm.all_reduce_add(partials[rank].clone(), residual)
            want = norm(all_reduce(partials[rank].clone()), residual)
            assert torch.equal(normed, want[0]) and torch.equal(summed, want[1]), (rank, dtype)
            assert torch.equal(summed, (partials[0] + partials[1]) + residual), (rank, dtype)  # reduced, then added
    finally:
        shutdown_tensor_parallel()


def test_over_gloo_it_is_the_all_reduce_then_the_add_and_norm_exactly(tmp_path):
    mp.spawn(_gloo_rank, args=(f"file://{tmp_path / 'rendezvous'}",), nprocs=2, join=True)


@pytest.mark.timeout(INTERPRETED_TIMEOUT_S + 60)
def test_interpreted_ranks_fused_decoder_layers_give_the_plain_paths_logits(tmp_path, tiny_checkpoint):
    paths = [str(tiny_checkpoint(kind)) for kind in INTERPRETED_FAMILIES]
    result = run_interpreted(str(tmp_path / "rendezvous"), *paths, module="tests.distributed.interpreted_decoder_layer")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-3000:]
