"""Offline throughput of LLM.generate: output tokens / wall seconds (W-nano).

    python -m roseray.bench throughput --workload nano --out nano.json
    python -m roseray.bench throughput --model /models/qwen3-30b-a3b --load-format dummy --max-model-len 4096
    python -m roseray.bench throughput --kv-cache-dtype fp8   # e4m3 KV cache: twice the tokens of bf16
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from roseray.bench.common import print_table, write_result
from roseray.bench.workloads import NANO_MODEL, nano_workload
from roseray.config import KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS
from roseray.llm import LLM
from roseray.sampling_params import SamplingParams


def run_nano(model: str, num_seqs: int, engine_args: dict) -> dict:
    prompts, params = nano_workload(num_seqs)
    llm = LLM(model, **engine_args)
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    errors = sum(o.outputs[0].finish_reason == "error" for o in outputs)
    if errors:
        raise RuntimeError(f"{errors} of {len(outputs)} requests ended with an engine error (see the log): "
                           "no throughput figure")
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.get_stats()
    return {"workload": "W-nano", "model": model, "engine_args": engine_args, "num_seqs": num_seqs,
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": output_tokens, "wall_s": wall,
            "output_tok_s": output_tokens / wall, "num_preemptions": stats.num_preemptions_total,
            "kv_capacity_tokens": llm.engine.kv_capacity_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["nano"], default="nano")
    parser.add_argument("--model", default=NANO_MODEL)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--cuda-graph-max-tokens", type=int, default=None,
                        help="largest step with prefill chunks run as piecewise CUDA graphs (0 = eager)")
    parser.add_argument("--load-format", default=None, choices=LOAD_FORMATS,
                        help="dummy: random weights in the geometry of a directory holding config.json only")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the engine spans")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="fp8: e4m3 weights with per-channel scales (quantized at load)")
    parser.add_argument("--out", default=None, help="write JSON here")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="auto: the model's dtype; fp8: e4m3 (scale 1.0 unless the checkpoint has its own)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = {"enforce_eager": args.enforce_eager, "kv_cache_dtype": args.kv_cache_dtype}
    if args.gpu_memory_utilization:
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.load_format:
        engine_args["load_format"] = args.load_format
    if args.max_model_len:
        engine_args["max_model_len"] = args.max_model_len
    if args.quantization:
        engine_args["quantization"] = args.quantization
    if args.tensor_parallel_size > 1:
        engine_args["tensor_parallel_size"] = args.tensor_parallel_size
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.cuda_graph_max_tokens is not None:
        engine_args["cuda_graph_max_tokens"] = args.cuda_graph_max_tokens
    result = run_nano(args.model, args.num_seqs, engine_args)
    print_table(f"W-nano on {args.model}", [
        ("requests", str(result["num_seqs"])),
        ("prompt / output tokens", f"{result['prompt_tokens']:,} / {result['output_tokens']:,}"),
        ("wall", f"{result['wall_s']:.2f} s"),
        ("throughput", f"{result['output_tok_s']:,.0f} output tok/s"),
        ("KV capacity", f"{result['kv_capacity_tokens']:,} tokens ({args.kv_cache_dtype} cache)"),
        ("preemptions", str(result["num_preemptions"]))])
    write_result(args.out, "throughput", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
