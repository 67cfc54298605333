"""Host time per decode step outside the model forward.

The model's forward and logits are replaced by stubs that return preallocated tensors,
so what is timed is the engine's own work per step: schedule + block manager + input
preparation (slot mapping, staging buffer) + sampling + bookkeeping (+ incremental
detokenization when --stream-text is given, as in serving).

    python -m roseray.bench step-overhead --num-seqs 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from roseray.bench.common import percentiles, print_table, write_result
from roseray.config import EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.sampling_params import SamplingParams


class StubForward:
    """Stands in for the model: returns preallocated hidden states and logits."""

    def __init__(self, hidden_size: int, vocab_size: int, max_tokens: int, max_rows: int) -> None:
        self.hidden = torch.zeros(max_tokens, hidden_size)
        self.logits = torch.randn(max_rows, vocab_size, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids, positions):
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


def measure(num_seqs: int, steps: int, stream_text: bool, model: str) -> dict:
    config = EngineConfig(model=model, device="cpu", max_num_seqs=num_seqs, max_num_batched_tokens=max(8192, num_seqs),
                          enable_prefix_caching=True, num_kv_blocks=num_seqs * 64)
    engine = LLMEngine(config)
    model_module = engine.runner.model
    stub = StubForward(engine.model_config.hidden_size, engine.model_config.vocab_size,
                       config.max_num_batched_tokens, num_seqs)
    model_module.forward = stub.forward
    model_module.compute_logits = stub.compute_logits

    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        prompt = rng.integers(0, 256, size=int(rng.integers(16, 64))).tolist()
        engine.add_request(f"s{i}", prompt, params, stream_text=stream_text)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.requests.values()):
        engine.step()  # prefill until every request decodes
    for _ in range(8):
        engine.step()  # warm-up decode steps

    times = []
    for _ in range(steps):
        started = time.perf_counter()
        deltas = engine.step()
        times.append(time.perf_counter() - started)
        assert len(deltas) == num_seqs
    return {"num_seqs": num_seqs, "steps": steps, "stream_text": stream_text,
            "ms_per_step": {k: v * 1e3 for k, v in percentiles(times, (50, 90, 99)).items()},
            "mean_ms": float(np.mean(times) * 1e3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.bench step-overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256], help="running sequences")
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps")
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--stream-text", action="store_true", help="also detokenize incrementally (serving)")
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = [measure(n, args.steps, args.stream_text, args.model) for n in args.num_seqs]
    rows = [(f"{r['num_seqs']} seqs" + (" +detok" if r["stream_text"] else ""),
             f"p50 {r['ms_per_step']['p50']:.3f} ms  p90 {r['ms_per_step']['p90']:.3f} ms  mean {r['mean_ms']:.3f} ms")
            for r in results]
    print_table("host time per decode step, model forward stubbed", rows)
    write_result(args.out, "step-overhead", {"results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
