"""roseray's abortable all-reduce kernel (ROSERAY_TP_ALL_REDUCE=triton) on two GPUs: it equals NCCL's sum
(bit for bit: on two ranks both add once in fp32 and round once) for bf16 and fp32 decode shapes, eagerly
and replayed 100 times from CUDA graphs (one call per graph, and a graph of calls whose grids differ); and
a rank 0 whose kernel waits for a rank 1 that never calls returns once the abort flag is set from another
thread, as do its later calls; the fused all-reduce + residual add + RMSNorm matches its reference.
Skipped without two CUDA devices. Every wait here is bounded: a kernel that never returns fails the
test (its processes are killed), never hangs it."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roseray.triton_all_reduce import TritonAllReduce
from roseray_kernels.tp_all_reduce import all_reduce_reference
from roseray_kernels.tp_all_reduce_norm import all_reduce_add_rmsnorm, all_reduce_add_rmsnorm_reference, takes_rows
from tests.kernels.helpers import rel_err
from tests.waiting import wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
SHAPES = [(1, 4096), (7, 4096), (64, 4096), (256, 4096), (1024, 4096), (3, 1024), (33, 8192), (512, 8192)]
# a graph of these calls in a row: one to all programs, both dtypes
CHAIN = [(1, 4096, torch.bfloat16), (256, 4096, torch.bfloat16), (5, 2048, torch.float32), (1024, 4096, torch.bfloat16),
         (2, 4096, torch.bfloat16)]
REPLAYS = 100
FUSED_SHAPES = [(1, 4096), (7, 4096), (256, 4096), (300, 2048), (64, 8192), (1024, 4096)]
EPS = 1e-6
NORM_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # as tests/kernels/test_fused_ops.py's rmsnorm
STILL_WAITING_S = 1.0  # rank 0's kernel is seen still waiting this long before the abort
ABORT_BOUND_S = 10.0  # its synchronize returns within this after the abort (it polls every few hundred spins)
PROCESS_TIMEOUT_S = 300


def _check(failures, what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if not torch.equal(got, expected):
        failures.put(f"{what}: max error {(got.float() - expected.float()).abs().max().item()}")


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    total = x.clone()
    dist.all_reduce(total)
    return total


def _sums(rank: int, failures) -> None:
    reduce = TritonAllReduce(dist.group.WORLD, torch.device("cuda", rank))
    generator = torch.Generator(device="cuda").manual_seed(rank)
    for dtype in (torch.bfloat16, torch.float32):
        for rows, hidden in SHAPES:
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=generator)
            if not reduce.takes(x):
                if dtype == torch.bfloat16 and x.nbytes <= 8 << 20:
                    failures.put(f"rank {rank}: [{rows}, {hidden}] bf16 not taken")
                continue
            what = f"rank {rank} [{rows}, {hidden}] {dtype}"
            expected = _nccl_sum(x)
            got = reduce(x)
            _check(failures, f"{what} eager vs NCCL", got, expected)
            every = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(every, x)
            _check(failures, f"{what} eager vs the fp32 reference", got, all_reduce_reference(every))
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = reduce(static)
            for i in range(REPLAYS):
                static.copy_(x * (i % 7 + 1) - i)
                graph.replay()
                _check(failures, f"{what} graph replay {i}", out, _nccl_sum(static))
            graph.reset()
    # one graph of calls with other grids and dtypes one after the other (the buffer halves alternate)
    inputs = [torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=generator) for rows, hidden, dtype in
              CHAIN]
    for x in inputs:  # compiled (each shape's specialization) before the capture
        reduce(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [reduce(x) for x in inputs]
    for i in range(REPLAYS):
        for x in inputs:
            x.mul_(-1)
        graph.replay()
        for j, (x, out) in enumerate(zip(inputs, outs)):
            _check(failures, f"rank {rank} chained graph replay {i} call {j}", out, _nccl_sum(x))
    graph.reset()
    torch.cuda.synchronize()


def _fused(rank: int, failures) -> None:
    """all_reduce_add_rmsnorm against its reference: the new residual exact, the normed rows as fused_norm's
    tests allow (the sum of squares in another order); eagerly and replayed from a graph."""
    reduce = TritonAllReduce(dist.group.WORLD, torch.device("cuda", rank))
    mine = torch.Generator(device="cuda").manual_seed(rank)
    shared = torch.Generator(device="cuda").manual_seed(100)  # the residual and weight: the same on every rank
    for dtype in (torch.bfloat16, torch.float32):
        for rows, hidden in FUSED_SHAPES:
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=mine)
            residual = torch.randn(rows, hidden, device="cuda", dtype=dtype, generator=shared)
            weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=shared)).to(dtype)
            if not takes_rows(x, residual, weight, reduce.peers):
                continue
            what = f"rank {rank} fused [{rows}, {hidden}] {dtype}"

            def check(label: str, got: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
                every = [torch.empty_like(x) for _ in range(2)]
                dist.all_gather(every, x)
                normed, summed = all_reduce_add_rmsnorm_reference(every, residual, weight, EPS)
                _check(failures, f"{what} {label} residual", got[1], summed)
                if rel_err(got[0], normed) > NORM_TOLERANCE[dtype]:
                    failures.put(f"{what} {label} normed: relative error {rel_err(got[0], normed)}")

            check("eager", all_reduce_add_rmsnorm(x, residual, weight, EPS, reduce.peers), x)
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = all_reduce_add_rmsnorm(static, residual, weight, EPS, reduce.peers)
            for i in range(REPLAYS):
                static.copy_(x * (i % 5 + 1))
                graph.replay()
                check(f"replay {i}", out, static)
            graph.reset()
    torch.cuda.synchronize()


def _abort(rank: int, failures, signalled) -> None:
    """Rank 1 only sets up the buffer and watches its signal pad; rank 0 calls, waits, and is aborted."""
    reduce = TritonAllReduce(dist.group.WORLD, torch.device("cuda", rank))
    if rank == 1:  # slot [program 0, rank 0] of my pad: rank 0's kernel has signalled me and now waits for me
        pad = reduce.handle.get_signal_pad(1, (1,), torch.int32, 0)
        wait_until(lambda: pad.item() == 1, timeout=60, message="rank 0's signal in rank 1's pad")
        signalled.set()
        dist.barrier()  # over NCCL: rank 0 is past its abort
        return
    x = torch.ones(64, 4096, device="cuda", dtype=torch.bfloat16)
    reduce(x)
    reduce(x)  # queued behind the first: also returns once aborted
    synchronized = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), synchronized.set()), daemon=True).start()
    if not signalled.wait(60):
        failures.put("rank 0's kernel never signalled rank 1")
    elif synchronized.wait(STILL_WAITING_S):
        failures.put("rank 0's kernel returned without rank 1 and without the abort")
    reduce.abort()
    if not synchronized.wait(ABORT_BOUND_S):
        failures.put(f"rank 0's kernel still waits {ABORT_BOUND_S:.0f} s after the abort")
        return  # the process is killed; a stuck GPU would hang the group's teardown
    dist.barrier()


def _rank(rank: int, init_method: str, test: str, failures, signalled) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=2)
    try:
        if test == "sums":
            _sums(rank, failures)
        elif test == "fused":
            _fused(rank, failures)
        else:
            _abort(rank, failures, signalled)
    except BaseException as error:  # noqa: BLE001 - reported to the test (an AssertionError from wait_until too)
        failures.put(f"rank {rank}: {error!r}")
        raise
    failures.put("done")
    dist.destroy_process_group()


def run_two_ranks(test: str, tmp_path) -> list[str]:
    context = mp.get_context("spawn")
    failures, signalled = context.Queue(), context.Event()
    processes = [context.Process(target=_rank, args=(r, f"file://{tmp_path}/rendezvous", test, failures, signalled))
                 for r in range(2)]
    for p in processes:
        p.start()
    reports, done = [], 0
    while done < 2:
        try:
            report = failures.get(timeout=PROCESS_TIMEOUT_S)
        except queue.Empty:
            reports.append(f"no word from the ranks within {PROCESS_TIMEOUT_S} s")
            break
        if report == "done":
            done += 1
        else:
            reports.append(report)
            if "still waits" in report:
                break
    for p in processes:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(10)
    return reports


@pytest.mark.timeout(PROCESS_TIMEOUT_S + 120)
def test_triton_all_reduce_equals_nccl_eagerly_and_from_cuda_graphs(tmp_path):
    problems = run_two_ranks("sums", tmp_path)
    assert not problems, problems[:20]


@pytest.mark.timeout(PROCESS_TIMEOUT_S + 120)
def test_fused_all_reduce_add_rmsnorm_matches_its_reference_eagerly_and_from_cuda_graphs(tmp_path):
    problems = run_two_ranks("fused", tmp_path)
    assert not problems, problems[:20]


@pytest.mark.timeout(PROCESS_TIMEOUT_S + 120)
def test_a_kernel_waiting_for_a_rank_that_never_comes_returns_once_aborted(tmp_path):
    problems = run_two_ranks("abort", tmp_path)
    assert not problems, problems
