"""The symmetric-memory all-reduce on two GPUs: one-shot and two-shot equal NCCL's sum for the
shapes a decode step reduces (bf16 and fp32), eagerly and replayed from a CUDA graph; a tensor
larger than the buffer goes through NCCL. Skipped without two CUDA devices."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roseray.symmetric_all_reduce import SymmetricAllReduce

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
HIDDEN = 4096


def _rank(rank: int, init_method: str, method: str, failures) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=2)
    try:
        reduce = SymmetricAllReduce(dist.group.WORLD, torch.device("cuda", rank), method)
        for dtype in (torch.bfloat16, torch.float32):
            for rows in (1, 7, 64, 256):
                x = torch.randn(rows, HIDDEN, device="cuda", dtype=dtype, generator=None) * (rank + 1)
                if not reduce.takes(x):
                    continue
                expected = x.clone()
                dist.all_reduce(expected)
                got = reduce(x)
                if not torch.equal(got, expected):
                    failures.put(f"rank {rank} {method} {dtype} {rows} rows: max err "
                                 f"{(got.float() - expected.float()).abs().max().item()}")
                static = x.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = reduce(static)
                static.copy_(x * 2)
                graph.replay()
                expected2 = x * 2
                dist.all_reduce(expected2)
                if not torch.equal(out, expected2):
                    failures.put(f"rank {rank} {method} {dtype} {rows} rows, graph replay differs")
                graph.reset()
        too_big = torch.ones(reduce.buffer.numel() // 2 + 8, device="cuda", dtype=torch.bfloat16)
        if reduce.takes(too_big):
            failures.put("a tensor larger than the buffer was taken")
        torch.cuda.synchronize()
        del reduce
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["one_shot", "two_shot", "symmetric"])
def test_symmetric_all_reduce_equals_nccl(method, tmp_path):
    context = mp.get_context("spawn")
    failures = context.Queue()
    processes = [context.Process(target=_rank, args=(r, f"file://{tmp_path}/rendezvous", method, failures))
                 for r in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(240)
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    problems = []
    while not failures.empty():
        problems.append(failures.get())
    assert not problems, problems
