"""The decoder layers' fused all-reduce + residual add + RMSNorm (ROSERAY_TP_ALL_REDUCE=triton) inside whole
tiny models, run by Triton's interpreter on CPU; started by test_reducing_norm.py with TRITON_INTERPRET=1 (read
when the kernels are decorated, so in a process of its own).

Two ranks as processes join a gloo group and load each checkpoint's shards; each runs the cache-less prefill
forward twice: with the group's plain all-reduces (gloo, then the torch add+RMSNorm: the path of every method
but triton), then with roseray's all-reduce over shared memory standing in for symmetric memory
(interpreted_all_reduce.py), where every add+RMSNorm after a block runs the fused kernel. The logits must agree
to fused_norm's fp32 tolerance (the sums are exact on two ranks; only the order of the norms' sums of squares
differs), the fused kernel must run twice per layer (after the attention, after the MLP: the next layer's input
norm or the final norm) and the plain kernel once (the embeddings), and the signal pads must end at 0.

    python -m tests.distributed.interpreted_decoder_layer RENDEZVOUS_FILE CHECKPOINT...   # "ok" or the problems
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.multiprocessing as mp

from roseray import distributed
from roseray.distributed import init_tensor_parallel, shutdown_tensor_parallel
from roseray.models.loader import load_model_config
from roseray.triton_all_reduce import TritonAllReduce
from roseray_kernels.tp_all_reduce import PeerBuffers
from tests.distributed.interpreted_all_reduce import peer_buffers, shared_memory
from tests.distributed.prefill import prefill_logits, prompts
from tests.kernels.helpers import rel_err

SIZE = 2
TOLERANCE = 1e-5  # fp32, as tests/kernels/test_fused_ops.py's rmsnorm


class CountingAllReduce(TritonAllReduce):
    """roseray's all-reduce over the given peer buffers, counting its plain and fused calls."""

    def __init__(self, peers: PeerBuffers) -> None:  # not TritonAllReduce's: no GPU, no symmetric memory
        self.peers, self.abort_flag, self.calls = peers, peers.abort_flag, Counter()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["plain"] += 1
        return super().__call__(x)

    def add_rmsnorm(self, x, residual, weight, eps):
        self.calls["fused"] += 1
        return super().add_rmsnorm(x, residual, weight, eps)


def _rank(rank: int, init: str, paths: list[str], buffers: list, pads: list, flags: list, results) -> None:
    init_tensor_parallel(rank, SIZE, init, "gloo")
    try:
        for index, path in enumerate(paths):
            plain = prefill_logits(path, prompts())
            reduce = distributed._SYMMETRIC = CountingAllReduce(peer_buffers(rank, buffers, pads, flags[rank]))
            try:
                fused = prefill_logits(path, prompts())
            finally:
                distributed._SYMMETRIC = None
            same_argmax = bool(torch.equal(plain.argmax(-1), fused.argmax(-1)))
            results[index, rank] = torch.tensor([rel_err(fused, plain), reduce.calls["fused"], reduce.calls["plain"],
                                                 same_argmax], dtype=torch.float64)
    finally:
        shutdown_tensor_parallel()


def check(rendezvous: str, paths: list[str]) -> list[str]:
    buffers, pads, flags = shared_memory(SIZE)
    results = torch.full((len(paths), SIZE, 4), float("nan"), dtype=torch.float64).share_memory_()
    mp.start_processes(_rank, args=(f"file://{rendezvous}", paths, buffers, pads, flags, results), nprocs=SIZE,
                       start_method="spawn")  # forked, torch's CPU matmuls hang (its thread pool)
    problems = []
    for path, per_rank in zip(paths, results.tolist()):
        layers = load_model_config(path).num_hidden_layers
        for rank, (error, fused_calls, plain_calls, same_argmax) in enumerate(per_rank):
            if not error <= TOLERANCE or not same_argmax:
                problems.append(f"{path} rank {rank}: fused vs plain logits' relative error {error}, same argmax "
                                f"{bool(same_argmax)}")
            if (fused_calls, plain_calls) != (2 * layers, 1):
                problems.append(f"{path} rank {rank}: {fused_calls:.0f} fused and {plain_calls:.0f} plain all-reduces "
                                f"in {layers} layers (expected {2 * layers} and 1)")
    if any(pad.any() for pad in pads):
        problems.append("the signal pads are not all 0 after the calls")
    return problems


if __name__ == "__main__":
    found = check(sys.argv[1], sys.argv[2:])
    print("\n".join(found) or "ok")
    sys.exit(1 if found else 0)
