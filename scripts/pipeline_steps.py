"""Is the engine loop bound by the GPU or by the host? Runs W-seed's decode on an in-process
LLMEngine stepped back to back as the engine process steps it (overlap on, text streamed,
each step's deltas encoded as a step message), without syncs, and reports per decode step:

  - wall: the loop's period (what TPOT becomes);
  - wait: how long the host blocked for the previous step's tokens (`PendingSample.result`);
    near 0 means the GPU waits on the host, near wall - host work means the host waits on
    the GPU;
  - host: wall - wait, the host's own work per step;
  - graph: the decode graph of the batch's bucket replayed back to back (its GPU time alone,
    at the context lengths of the last timed step: longer than the average step's).

    python scripts/pipeline_steps.py [--num-seqs 128] [--steps 400]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from roseray.bench.workloads import SEED_MODEL
from roseray.config import EngineConfig
from roseray.engine import sampler as sampler_module
from roseray.engine.engine import LLMEngine
from roseray.engine.engine_process import _stats, encode_step
from roseray.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=128)
    parser.add_argument("--steps", type=int, default=400, help="decode steps to time (max_tokens is this + 40)")
    parser.add_argument("--model", default=SEED_MODEL)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.num_seqs, enable_prefix_caching=False,
                                    max_model_len=args.steps + 64))
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 40, ignore_eos=True)
    waits = []
    result = sampler_module.PendingSample.result

    def timed_result(self):
        t = time.perf_counter()
        out = result(self)
        waits.append(time.perf_counter() - t)
        return out

    sampler_module.PendingSample.result = timed_result
    for i in range(args.num_seqs):
        engine.add_request(f"r{i}", [15496], params)
    for _ in range(20):  # prefill and the first decode steps
        encode_step(engine.step(), _stats(engine), None)
    waits.clear()
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        encode_step(engine.step(), _stats(engine), None)
        walls.append(time.perf_counter() - t)
    waits = waits[-len(walls):]
    torch.cuda.synchronize()
    bucket = min(b for b in engine.runner.graphs if b >= args.num_seqs)
    graph = engine.runner.graphs[bucket]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        graph.replay()
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    graph_ms = start.elapsed_time(end) / 200
    walls_ms, waits_ms = np.array(walls) * 1e3, np.array(waits) * 1e3
    host_ms = walls_ms - waits_ms
    print(f"{torch.cuda.get_device_name()}  {args.model}  batch {args.num_seqs} (graph bucket {bucket}), "
          f"{args.steps} decode steps")
    for name, values in (("wall", walls_ms), ("wait", waits_ms), ("host", host_ms)):
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        print(f"  {name:<5} p50 {p50:.3f} ms  p90 {p90:.3f} ms  p99 {p99:.3f} ms  mean {values.mean():.3f} ms")
    print(f"  graph {graph_ms:.3f} ms per replay (back to back)")


if __name__ == "__main__":
    main()
