"""python -m roseray.bench <benchmark> [options]: the benchmarks are listed in BENCHMARKS below."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "throughput": ("roseray.bench.throughput", "offline throughput of LLM.generate (W-nano)"),
    "stream": ("roseray.bench.stream", "streaming decode through the async engine (W-seed)"),
    "serving": ("roseray.bench.serving", "W-seed through HTTP against the in-process engine, in one run"),
    "kernels": ("roseray.bench.kernels", "Triton KV-append, paged-attention (and --moe: fused-MoE) microbenchmarks"),
    "step-overhead": ("roseray.bench.step_overhead", "host time per decode step outside the model forward"),
    "structured": ("roseray.bench.structured", "json_schema responses vs unconstrained, against any OpenAI server"),
    "json-tokenizer": ("roseray.bench.json_tokenizer", "a byte-level BPE tokenizer for W-json on random weights"),
    "routing-sim": ("roseray.bench.routing_sim_cli", "routing policies over N simulated replicas (real scheduler)"),
    "step-time": ("roseray.bench.step_time_fit", "engine step times by shape, fit of routing-sim's step-time model"),
    "routing-replay": ("roseray.bench.routing_replay", "routing-sim's workload against a real server (--compare-sim)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: python -m roseray.bench <benchmark> [options]   (<benchmark> --help for its options)\n")
        for name, (_, text) in BENCHMARKS.items():
            print(f"  {name:<14} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(BENCHMARKS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
