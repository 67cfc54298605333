"""`roseray serve | generate | bench` on the command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from roseray.config import EngineConfig

ENGINE_ARG_HELP = {
    "model": "a local Hugging Face directory, a hub id already in the local HF cache, or random:<preset> "
             "(random:tiny, random:gpt2, random:qwen3-0.6b, random:llama-3.2-1b)",
    "tokenizer": "tokenizer to load (default: the model's)",
    "dtype": "weights and KV cache dtype: auto (bf16 on GPU, fp32 on CPU), float32, float16, bfloat16",
    "device": "auto, cuda or cpu",
    "seed": "seed for random weights of random:* presets and unseeded sampling",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "number of KV blocks (default: sized from gpu_memory_utilization, or cpu_kv_cache_gib on CPU)",
    "gpu_memory_utilization": "fraction of GPU memory roseray may use (weights + activations + KV cache)",
    "cpu_kv_cache_gib": "KV cache budget in GiB when running on CPU",
    "max_model_len": "longest prompt + output in tokens (default: the model's max positions)",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one engine step (prefill chunks + decodes)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "enforce_eager": "never use CUDA graphs",
    "attention_backend": "auto (triton on CUDA, torch on CPU), triton or torch",
    "max_waiting_requests": "queue limit; the server answers 429 past it",
    "max_logprobs": "largest logprobs a request may ask for",
    "cuda_graph_max_batch_size": "largest decode batch captured in a CUDA graph",
    "cuda_graph_max_tokens": "largest step with prefill chunks run as piecewise CUDA graphs (attention eager between "
                             "them); 0 runs such steps eagerly",
    "async_scheduling": "launch step N+1 before processing step N's tokens, overlapping host work with the GPU "
                        "(default: on for CUDA)",
    "engine_process": "serving: run the engine loop in its own process, so that the HTTP server and the "
                      "engine do not share one GIL (default: on for CUDA)",
    "revision": "model revision in the HF cache",
    "trust_remote_code": "unused: roseray runs its own model code only",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = ENGINE_ARG_HELP.get(f.name, "")
        if f.type in ("bool", bool, "bool | None"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
        group.add_argument(flag, type=kind, default=f.default, help=f"{help_text} (default: %(default)s)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="roseray",
        description="roseray: a continuous-batching LLM engine with a paged KV cache, served on Ray Serve. "
                    "For the multi-replica Ray Serve app use `serve run serve_config.yaml`.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts, offline",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    add_engine_args(gen)

    serve = sub.add_parser("serve", help="serve the OpenAI API from one in-process engine (no Ray)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require this bearer key on every route but /health and /ready "
                            "(default: $ROSERAY_API_KEY if set)")
    serve.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    serve.add_argument("--log-prompts", action="store_true", help="log prompt text (off by default)")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish on shutdown; new ones get 503 meanwhile")
    serve.add_argument("--cors-origin", action="append", default=[], dest="cors_origins", metavar="ORIGIN",
                       help="a browser origin allowed to call the API, e.g. https://app.example.com (repeat; "
                            "none by default: CORS closed)")
    serve.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                       help="request bodies larger than this get 413 (default: %(default)s)")
    serve.add_argument("--api-processes", type=int, default=1, metavar="N",
                       help="HTTP (API) processes in front of the one engine process (default: 1). One API "
                            "process spends ~8 us of CPU per streamed token, so it writes every stream every step "
                            "up to ~80 streams at a 0.66 ms engine step (~160 at 1.3 ms); beyond that it falls "
                            "behind and clients get several tokens per chunk. N > 1 (Linux): N processes share the "
                            "port (SO_REUSEPORT), each streams its own connections; the engine runs in its own "
                            "process. Each process checks the engine-wide queue against --max-waiting-requests, "
                            "so the limit holds for the server as a whole; /metrics from any process sums the "
                            "per-request metrics of all (the others' part up to 1 s old)")
    add_engine_args(serve)

    bench = sub.add_parser("bench", help="benchmarks: throughput, stream, kernels, step-overhead",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from roseray.bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        api_key = args.api_key or os.environ.get("ROSERAY_API_KEY") or None
        if args.api_processes < 1:
            build_parser().error("--api-processes must be at least 1")
        if args.api_processes > 1:
            return _serve_api_processes(args, api_key)
        from roseray.openai_api.standalone import run_standalone  # FastAPI/uvicorn only when serving

        run_standalone(engine_config_from_args(args), host=args.host, port=args.port, api_key=api_key,
                       served_model_name=args.served_model_name, log_prompts=args.log_prompts,
                       drain_timeout_s=args.drain_timeout, cors_origins=args.cors_origins,
                       max_body_bytes=args.max_body_bytes)
        return 0
    return 2


def _serve_api_processes(args: argparse.Namespace, api_key: str | None) -> int:
    from roseray.openai_api.api_processes import run_api_processes  # serving only

    settings = {"api_key": api_key, "served_model_name": args.served_model_name, "log_prompts": args.log_prompts,
                "drain_timeout_s": args.drain_timeout, "cors_origins": args.cors_origins,
                "max_body_bytes": args.max_body_bytes}
    # the engine lives in its own process whatever --engine-process says
    config = dataclasses.replace(engine_config_from_args(args), engine_process=True)
    return run_api_processes(config, args.api_processes, host=args.host, port=args.port, server_settings=settings)


def _generate(args: argparse.Namespace) -> int:
    from roseray.llm import LLM  # loads torch and the models: only when generating
    from roseray.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(engine_config_from_args(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    for prompt, output in zip(args.prompt, llm.generate(args.prompt, params)):
        completion = output.outputs[0]
        print(f"--- prompt: {prompt!r}")
        print(f"{completion.text}")
        print(f"--- {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
