"""roseray_kernels.tp_all_reduce run by Triton's interpreter on CPU, started by test_triton_all_reduce.py
with TRITON_INTERPRET=1 (read when the kernels are decorated, so in a process of its own).

Ranks are processes; every rank's buffer, signal pad and abort flag are shared memory, and each rank's
pointer tables hold its own mappings of them, as symmetric memory's do. What this shows: the protocol's
logic (each program's slice, the signal slots, signals consumed so that the pads end at 0, both ranks
agreeing on the buffer half call after call whatever the grid, the abort), not the GPU's memory
ordering (the interpreter runs a program's threads as one, its loads and atomics in program order).

    python -m tests.distributed.interpreted_all_reduce sums WORLD_SIZE   # prints "ok" or the problems
    python -m tests.distributed.interpreted_all_reduce fused              # all_reduce_add_rmsnorm among sums
    python -m tests.distributed.interpreted_all_reduce abort
"""

from __future__ import annotations

import random
import sys
import threading
import time

import torch
import torch.multiprocessing as mp

from roseray_kernels.tp_all_reduce import PeerBuffers, all_reduce_reference, one_shot_all_reduce
from roseray_kernels.tp_all_reduce_norm import all_reduce_add_rmsnorm, all_reduce_add_rmsnorm_reference
from tests.kernels.helpers import rel_err
from tests.waiting import wait_until

HALF_BYTES = 64 << 10
PAD_SLOTS = 1024
MAX_PROGRAMS = 4
# [rows, hidden, dtype]: one to MAX_PROGRAMS programs (a program's block is 8 KiB), tails, both dtypes; an
# odd count of calls, so that the parity ends at 1
CALLS = [(1, 1024, torch.bfloat16), (3, 4096, torch.float32), (5, 2048, torch.bfloat16), (2, 1024, torch.float32),
         (7, 1032, torch.bfloat16), (1, 8192, torch.bfloat16), (16, 1024, torch.float32)]
# ("norm" | "sum", rows, hidden, dtype): the fused kernel's calls among plain ones (they share the call parity);
# rows past MAX_PROGRAMS (programs loop), hidden not a power of two (masked columns)
FUSED_CALLS = [("norm", 3, 1024, torch.float32), ("sum", 1, 1024, torch.bfloat16), ("norm", 9, 1536, torch.float32),
               ("norm", 5, 2048, torch.bfloat16), ("sum", 4, 1024, torch.float32), ("norm", 1, 4096, torch.float32),
               ("norm", 2, 1024, torch.bfloat16)]  # an odd count: the parity ends at 1
EPS = 1e-6
SKEW_S = 0.01  # each rank sleeps up to this before each call
ABORT_WAIT_S = 60.0
STILL_WAITING_S = 0.5  # how long rank 0's kernel is seen still waiting before the abort (it would wait for good)


def shared_memory(world_size: int) -> tuple[list, list, list]:
    """Each rank's buffer (two halves), signal pad and abort flag, all zero."""
    buffers = [torch.zeros(2 * HALF_BYTES, dtype=torch.uint8).share_memory_() for _ in range(world_size)]
    pads = [torch.zeros(PAD_SLOTS, dtype=torch.int32).share_memory_() for _ in range(world_size)]
    flags = [torch.zeros(1, dtype=torch.int32).share_memory_() for _ in range(world_size)]
    return buffers, pads, flags


def peer_buffers(rank: int, buffers: list, pads: list, flag: torch.Tensor) -> PeerBuffers:
    return PeerBuffers(rank=rank, world_size=len(buffers),
                       buffer_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
                       signal_pad_ptrs=torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64),
                       half_bytes=HALF_BYTES, state=torch.zeros(2, dtype=torch.int32), abort_flag=flag,
                       max_programs=MAX_PROGRAMS)


def to_bf16_as_interpreted(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to bf16 toward zero, as the interpreter rounds (a GPU rounds to nearest even)."""
    return (x.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def interpreted_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """all_reduce_reference(xs), rounded as the interpreter rounds."""
    total = all_reduce_reference([x.float() for x in xs])
    return to_bf16_as_interpreted(total) if xs[0].dtype == torch.bfloat16 else total


def _rank_calls(rank: int, buffers: list, pads: list, flags: list, inputs: list, outputs: list, states) -> None:
    peers = peer_buffers(rank, buffers, pads, flags[rank])
    skew = random.Random(rank)
    for x, out in zip(inputs, outputs):
        time.sleep(skew.random() * SKEW_S)  # the ranks' calls overlap differently each time
        out[rank].copy_(one_shot_all_reduce(x[rank], peers))
    states[rank].copy_(peers.state)


def check_sums(world_size: int) -> list[str]:
    """Every rank makes CALLS in order; the problems found (none: []). The sums exact: fp32's, and bf16's as
    the interpreter rounds them."""
    torch.manual_seed(world_size)
    buffers, pads, flags = shared_memory(world_size)
    inputs = [torch.randn(world_size, rows, hidden).to(dtype).share_memory_() for rows, hidden, dtype in CALLS]
    outputs = [torch.full((world_size, rows, hidden), float("nan"), dtype=dtype).share_memory_()
               for rows, hidden, dtype in CALLS]
    states = torch.full((world_size, 2), -1, dtype=torch.int32).share_memory_()
    mp.start_processes(_rank_calls, args=(buffers, pads, flags, inputs, outputs, states), nprocs=world_size,
                       start_method="fork")
    problems = []
    for (rows, hidden, dtype), x, out in zip(CALLS, inputs, outputs):
        expected = interpreted_sum(list(x))
        for rank in range(world_size):
            if not torch.equal(out[rank], expected):
                problems.append(f"rank {rank}, [{rows}, {hidden}] {dtype}: max error "
                                f"{(out[rank].float() - expected.float()).abs().max().item()}")
    for rank, pad in enumerate(pads):
        if pad.any():
            problems.append(f"rank {rank}'s signal pad is not all 0 after the calls: slots {pad.nonzero().flatten()}")
    if states.tolist() != [[len(CALLS) % 2, 0]] * world_size:
        problems.append(f"the ranks' [parity, finished] after {len(CALLS)} calls: {states.tolist()}")
    return problems


def _rank_fused_calls(rank: int, buffers: list, pads: list, flags: list, calls: list, states) -> None:
    peers = peer_buffers(rank, buffers, pads, flags[rank])
    skew = random.Random(rank)
    for (kind, *_), (x, residual, weight, out, residual_out) in zip(FUSED_CALLS, calls):
        time.sleep(skew.random() * SKEW_S)
        if kind == "sum":
            out[rank].copy_(one_shot_all_reduce(x[rank], peers))
        else:
            normed, summed = all_reduce_add_rmsnorm(x[rank], residual, weight, EPS, peers)
            out[rank].copy_(normed)
            residual_out[rank].copy_(summed)
    states[rank].copy_(peers.state)


def check_fused() -> list[str]:
    """Two ranks make FUSED_CALLS in order; the problems found. The sums and the new residual exact (bf16 as
    the interpreter rounds), the normed rows to fp32 rounding (the sum of squares in another order), or in
    bf16 as fused_norm's tests allow (the interpreter's rounding differs in two more places)."""
    torch.manual_seed(7)
    buffers, pads, flags = shared_memory(2)
    calls = []
    for _, rows, hidden, dtype in FUSED_CALLS:
        calls.append([torch.randn(2, rows, hidden).to(dtype).share_memory_(),
                      torch.randn(rows, hidden).to(dtype).share_memory_(),
                      (1 + 0.1 * torch.randn(hidden)).to(dtype).share_memory_(),
                      torch.full((2, rows, hidden), float("nan"), dtype=dtype).share_memory_(),
                      torch.full((2, rows, hidden), float("nan"), dtype=dtype).share_memory_()])
    states = torch.full((2, 2), -1, dtype=torch.int32).share_memory_()
    mp.start_processes(_rank_fused_calls, args=(buffers, pads, flags, calls, states), nprocs=2, start_method="fork")
    problems = []
    for (kind, rows, hidden, dtype), (x, residual, weight, out, residual_out) in zip(FUSED_CALLS, calls):
        if kind == "sum":
            pairs = [(out, interpreted_sum(list(x)))]
        else:
            normed = all_reduce_add_rmsnorm_reference(list(x), residual, weight, EPS)[0]
            summed = interpreted_sum([interpreted_sum(list(x)), residual])  # the sum rounded, then the add
            pairs = [(out, normed), (residual_out, summed)]
        for i, (got, expected) in enumerate(pairs):
            exact = not (kind == "norm" and i == 0)
            for rank in range(2):
                error = rel_err(got[rank], expected)
                if error > (0 if exact else 1e-6 if dtype == torch.float32 else 2e-2):
                    problems.append(f"rank {rank}, {kind} [{rows}, {hidden}] {dtype} output {i}: relative error "
                                    f"{error}")
    if any(pad.any() for pad in pads) or states.tolist() != [[len(FUSED_CALLS) % 2, 0]] * 2:
        problems.append(f"pads or [parity, finished] not as after {len(FUSED_CALLS)} calls: {states.tolist()}")
    return problems


def check_abort() -> list[str]:
    """Rank 0 of 2 calls while rank 1 never does: its kernel signals rank 1 and waits; once that is seen,
    another thread sets the abort flag, and the call returns."""
    buffers, pads, flags = shared_memory(2)
    peers = peer_buffers(0, buffers, pads, flags[0])
    returned = threading.Event()
    result = []

    def call() -> None:
        result.append(one_shot_all_reduce(torch.ones(1, 1024), peers))
        returned.set()

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    # slot [program 0, rank 0] of rank 1's pad: rank 0 has signalled, and waits for rank 1 from now on
    wait_until(lambda: pads[1][0].item() == 1 or returned.is_set(), timeout=ABORT_WAIT_S,
               message="rank 0's kernel never signalled rank 1")
    if returned.wait(STILL_WAITING_S):
        return ["rank 0's kernel returned without rank 1 and without the abort"]
    flags[0].fill_(1)
    if not returned.wait(ABORT_WAIT_S):
        return [f"rank 0's kernel still waits {ABORT_WAIT_S:.0f} s after the abort"]
    return [] if peers.state.tolist() == [1, 0] else [f"[parity, finished] after the aborted call: {peers.state}"]


if __name__ == "__main__":
    found = {"sums": lambda: check_sums(int(sys.argv[2])), "fused": check_fused, "abort": check_abort}[sys.argv[1]]()
    print("\n".join(found) or "ok")
    sys.exit(1 if found else 0)
