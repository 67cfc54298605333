"""roseray's own all-reduce kernel (ROSERAY_TP_ALL_REDUCE=triton) where no GPU is needed: the method's
name and its choice (never on CPU), the tensors the kernel takes and its reference sum, the watchdog's
abort reaching the live all-reduce's flag, the fused all-reduce + residual add + RMSNorm's host side,
and both kernels' protocol run by Triton's interpreter with ranks as processes over shared memory
(interpreted_all_reduce.py). On two GPUs: test_gpu_triton_all_reduce.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from roseray import distributed, envs
from roseray.distributed import TensorParallel, abort_tensor_parallel
from roseray.symmetric_all_reduce import METHODS, symmetric_all_reduce
from roseray.triton_all_reduce import TritonAllReduce
from roseray_kernels.tp_all_reduce import (
    PeerBuffers,
    all_reduce_reference,
    one_shot_all_reduce,
    signal_pad_bytes,
    takes,
)
from roseray_kernels.tp_all_reduce_norm import all_reduce_add_rmsnorm, all_reduce_add_rmsnorm_reference, takes_rows

REPO = Path(__file__).resolve().parents[2]
INTERPRETED_TIMEOUT_S = 240  # a protocol that deadlocks shows as this timeout


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def cpu_peers(half_bytes: int = 1 << 20) -> PeerBuffers:
    """PeerBuffers good for the host-side checks (nothing launches)."""
    return PeerBuffers(rank=0, world_size=2, buffer_ptrs=torch.zeros(2, dtype=torch.int64),
                       signal_pad_ptrs=torch.zeros(2, dtype=torch.int64), half_bytes=half_bytes,
                       state=torch.zeros(2, dtype=torch.int32), abort_flag=torch.zeros(1, dtype=torch.int32),
                       max_programs=4)


def test_triton_is_a_method_that_the_variable_names_and_cpu_never_uses(gloo_group, monkeypatch):
    monkeypatch.setenv(envs.TP_ALL_REDUCE_ENV, "triton")
    assert envs.tp_all_reduce() == "triton" and "triton" in METHODS
    assert symmetric_all_reduce(gloo_group, torch.device("cpu"), "triton") is None
    with pytest.raises(ValueError, match="two_shot, triton"):  # the error lists the methods
        symmetric_all_reduce(gloo_group, torch.device("cpu"), "tritton")


def test_the_kernel_takes_small_dense_bf16_and_fp32_tensors_only():
    peers = cpu_peers(half_bytes=1 << 20)
    assert takes(torch.zeros(256, 2048, dtype=torch.bfloat16), peers)  # exactly half the buffer
    assert takes(torch.zeros(1, 1024, dtype=torch.float32), peers)
    assert not takes(torch.zeros(256, 2048 + 8, dtype=torch.bfloat16), peers)  # over
    assert not takes(torch.zeros(1, 1028, dtype=torch.bfloat16), peers)  # 2056 bytes: not a multiple of 16
    assert not takes(torch.zeros(8, 1024, dtype=torch.float16), peers)
    assert not takes(torch.zeros(1024, 8, dtype=torch.float32).t(), peers)  # not contiguous
    assert not takes(torch.zeros(0, 1024, dtype=torch.float32), peers)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        one_shot_all_reduce(torch.zeros(8, 1024, dtype=torch.float16), peers)
    assert signal_pad_bytes(132, 8) == 132 * 8 * 4


def test_the_fused_kernel_takes_rows_with_a_residual_and_weight_of_their_dtype():
    peers = cpu_peers(half_bytes=1 << 20)
    x, residual, weight = torch.zeros(4, 1024), torch.zeros(4, 1024), torch.ones(1024)
    assert takes_rows(x, residual, weight, peers)
    assert not takes_rows(x, residual[:2], weight, peers)
    assert not takes_rows(x, residual.bfloat16(), weight, peers)
    assert not takes_rows(x, residual, weight[:512], peers)
    assert not takes_rows(x.view(-1), residual.view(-1), weight, peers)  # rows, not a flat tensor
    assert not takes_rows(torch.zeros(4, 1026), torch.zeros(4, 1026), torch.ones(1026), peers)  # 4104-byte rows
    with pytest.raises(ValueError, match="residual"):
        all_reduce_add_rmsnorm(x, residual[:2], weight, 1e-6, peers)
    xs = [torch.randn(3, 64), torch.randn(3, 64)]
    normed, summed = all_reduce_add_rmsnorm_reference(xs, residual[:3, :64], weight[:64], 1e-6)
    assert torch.equal(summed, xs[0] + xs[1] + residual[:3, :64])
    torch.testing.assert_close(normed, summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_the_reference_sums_in_fp32_and_rounds_once():
    one, eps = torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2 ** -9], dtype=torch.bfloat16)
    # bf16 adds one at a time lose each 2^-9 (a quarter of bf16's step at 1.0); the fp32 sum keeps their
    # 3 x 2^-9 total, which rounds up to one step
    assert (one + eps + eps + eps).item() == 1.0
    assert all_reduce_reference([one, eps, eps, eps]).item() == 1.0 + 2 ** -7
    assert all_reduce_reference([one, eps, eps, eps]).dtype == torch.bfloat16


def host_side_all_reduce() -> TritonAllReduce:
    """A TritonAllReduce of which only the host side is there (the real one needs GPUs)."""
    reduce = TritonAllReduce.__new__(TritonAllReduce)
    reduce.abort_flag = torch.zeros(1, dtype=torch.int32)
    return reduce


def test_the_watchdogs_abort_sets_the_flag_of_the_live_all_reduce(gloo_group, monkeypatch):
    reduce = host_side_all_reduce()
    tp = TensorParallel(rank=0, size=2, group=gloo_group, host_group=gloo_group)
    monkeypatch.setattr(distributed, "_CURRENT", tp)
    monkeypatch.setattr(distributed, "_SYMMETRIC", reduce)
    monkeypatch.setattr(distributed, "_aborted", False)
    abort_tensor_parallel(TensorParallel(rank=0, size=2, group=gloo_group))  # a group this process left: nothing
    assert not reduce.aborted
    abort_tensor_parallel(tp)
    assert reduce.aborted and reduce.abort_flag.item() == 1
    with pytest.raises(RuntimeError, match="aborted"):
        distributed.all_reduce(torch.ones(4))


def test_a_shutdown_after_a_rank_died_sets_the_flag_and_keeps_the_buffer(monkeypatch):
    reduce, abandoned = host_side_all_reduce(), []
    monkeypatch.setattr(distributed, "_SYMMETRIC", reduce)
    monkeypatch.setattr(distributed, "_ABANDONED", abandoned)
    distributed.shutdown_tensor_parallel(abort=True)  # this process is in no group: nothing else to leave
    assert reduce.aborted and abandoned == [reduce] and distributed._SYMMETRIC is None


def run_interpreted(*args: str,
                    module: str = "tests.distributed.interpreted_all_reduce") -> subprocess.CompletedProcess:
    """`python -m module *args` under Triton's interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / ".pkgs"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=INTERPRETED_TIMEOUT_S)


@pytest.mark.timeout(INTERPRETED_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_interpreted_ranks_sum_call_after_call_and_leave_the_signal_pads_at_zero(world_size):
    result = run_interpreted("sums", str(world_size))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-3000:]


@pytest.mark.timeout(INTERPRETED_TIMEOUT_S + 60)
def test_interpreted_ranks_all_reduce_add_and_rmsnorm_among_plain_all_reduces():
    result = run_interpreted("fused")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-3000:]


@pytest.mark.timeout(INTERPRETED_TIMEOUT_S + 60)
def test_an_interpreted_rank_waiting_for_a_peer_that_never_comes_returns_once_aborted():
    result = run_interpreted("abort")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr[-3000:]
