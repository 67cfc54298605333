"""The peer: Hugging Face transformers' own continuous batching (`generate_batch`,
paged attention) on W-seed, so roseray's figure is a ratio measured in one run.

    python -m roseray.bench.peer_hf --out hf_seed.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers

from roseray.bench.common import percentiles, print_table, write_result
from roseray.bench.workloads import seed_workload


def run_hf_seed(num_requests: int = 128, max_tokens: int = 128) -> dict:
    prompts, _ = seed_workload(num_requests)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to("cuda", torch.bfloat16).eval()
    gen = transformers.GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                        pad_token_id=0, use_cuda_graph=False)
    model.generate_batch(prompts[:4], generation_config=gen, max_new_tokens=8)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=gen, record_timestamps=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    result = {"peer": f"transformers {transformers.__version__} generate_batch", "num_requests": num_requests,
              "completion_tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall}
    stamps = [o.timestamps for o in outputs.values() if getattr(o, "timestamps", None)]
    if stamps:
        itl = np.concatenate([np.diff(s) for s in stamps if len(s) > 1])
        tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
        ttft = [s[0] - started for s in stamps]
        result.update(ttft_ms={k: v * 1e3 for k, v in percentiles(ttft).items()},
                      tpot_ms={k: v * 1e3 for k, v in percentiles(tpot).items()},
                      itl_ms={k: v * 1e3 for k, v in percentiles(itl).items()})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roseray.bench.peer_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = run_hf_seed(args.num_requests)
    print_table("W-seed, transformers continuous batching", [
        ("throughput", f"{result['throughput_tok_s']:,.0f} tok/s"), ("wall", f"{result['wall_s']:.2f} s")])
    write_result(args.out, "peer-hf-seed", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
