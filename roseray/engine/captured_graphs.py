"""A runner's captured CUDA graphs, held apart from the runner so that they can be destroyed first.

NCCL's teardown of a communicator (destroy or abort) waits until every CUDA graph that captured
one of its collectives has been destroyed. Under tensor parallelism the decode graphs and the
piecewise graphs capture the layers' all-reduces, so each rank destroys its graphs before it
leaves the group (roseray.engine.tensor_parallel_workers); rank 0 does it from the runner's
finalizer, which runs before the runner's own attributes are freed and so holds this object.
"""

from __future__ import annotations

import torch

from roseray.engine.piecewise_graphs import PiecewiseGraphs


class CapturedGraphs:
    def __init__(self) -> None:
        self.decode: dict[int, torch.cuda.CUDAGraph] = {}  # decode-only steps, by batch size
        self.decode_logits: dict[int, torch.Tensor] = {}  # each decode graph's logits output
        self.piecewise: PiecewiseGraphs | None = None  # steps with prefill chunks, by token count

    def release(self, wait: bool = True) -> None:
        """Destroy every graph (the runner runs eagerly afterwards); `wait`: after the device's
        queued work, which may still replay them (not when a rank is gone: it would never end)."""
        if wait and torch.cuda.is_available() and (self.decode or self.piecewise is not None):
            torch.cuda.synchronize()
        # reset() destroys a graph now, whoever else still refers to it (a cycle would keep it alive)
        for graph in self.decode.values():
            graph.reset()
        self.decode.clear()
        self.decode_logits.clear()
        if self.piecewise is not None:
            for piecewise in self.piecewise.graphs.values():
                for graph in piecewise.pieces:
                    graph.reset()
            self.piecewise.graphs.clear()
            self.piecewise = None
