"""`roseray serve | generate | bench` on the command line.

Errors are one line on stderr: exit 2 for a usage error (a flag the subcommand does not
know, a value its parser or EngineConfig/ServerConfig refuses; printed under the
subcommand's usage), exit 1 for a failure while running (a model that cannot be loaded, a
sampling parameter the engine refuses, `--device cuda` without CUDA). `--debug` (or
ROSERAY_DEBUG=1) shows the traceback instead. Ctrl-C ends quietly with exit 130 (`serve`
drains first; uvicorn then raises the SIGINT it held back).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from roseray import envs
from roseray.config import REMOVED_ENGINE_ARGS, TOOL_CALL_PARSERS, EngineConfig, ServerConfig

EXIT_RUNTIME_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C ended

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
    "load_format": "auto or safetensors: the checkpoint's weights; dummy: seeded random weights in the "
                   "checkpoint's geometry (a directory with config.json and tokenizer files only), for benchmarks",
    "reasoning_parser": "how the model marks its reasoning (qwen3: <think>...</think> in the output; deepseek_r1: "
                        "the template opens <think>, the output closes it): chat responses carry it as "
                        "reasoning_content (and reasoning), content without it, and a structured output "
                        "applies after it (default: none, the reasoning stays in the content)",
    "quantization": "fp8: e4m3 weights with a scale per output channel, quantized at load from a bf16/fp16 "
                    "checkpoint (fp8 checkpoints are fp8 without it); needs an NVIDIA GPU of compute capability "
                    "8.9+ (Ada, Hopper); on CPU a reference path runs",
    "kv_cache_dtype": "auto: the KV cache in the model's dtype; fp8: e4m3 with a scale per layer, twice the tokens",
    "tensor_parallel_size": "GPUs one engine replica spans (its layers and MoE experts sharded across them; every "
                            "family but GPT-2); on CPU, processes over gloo",
    "grammar_workers": "processes that run the grammar matchers of structured outputs (each step's token accept "
                       "and next-token mask), beside the engine (default: a quarter of the CPU cores, 1 to 4)",
    "kv_cache_scale": "fp8 KV cache: the scale of every layer's K and V (stored = value / scale; default: the "
                      "checkpoint's k_scale/v_scale, else 1.0)",
}

SERVER_DEFAULTS = ServerConfig()
REMOVED_FLAGS = {"--" + name.replace("_", "-"): reason for name, reason in REMOVED_ENGINE_ARGS.items()}


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's default once, after its help: not where the help already says its default,
    and not for a default that says nothing (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS or default == []):
            return text
        return f"{text} (default: %(default)s)"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = ENGINE_ARG_HELP[f.name]
        if f.type in ("bool", bool, "bool | None"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
        group.add_argument(flag, type=kind, default=f.default, help=help_text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=SERVER_DEFAULTS.host,
                       help="address to bind; 127.0.0.1 keeps the server to this machine")
    group.add_argument("--port", type=int, default=SERVER_DEFAULTS.port, help="port to listen on (0: any free port)")
    group.add_argument("--api-key", default=None,
                       help=f"require this bearer key on every route but /health and /ready "
                            f"(default: ${envs.API_KEY_ENV} if set, else none)")
    group.add_argument("--served-model-name", default=None,
                       help="model id clients send and /v1/models lists (default: --model)")
    group.add_argument("--log-prompts", action="store_true", help="log prompt text (off by default: user data)")
    group.add_argument("--log-requests", action="store_true",
                       help="log one line per finished request (token counts and time, no text)")
    group.add_argument("--drain-timeout", type=float, default=SERVER_DEFAULTS.drain_timeout_s, metavar="SECONDS",
                       help="seconds running requests get to finish on shutdown; new ones get 503 meanwhile")
    group.add_argument("--cors-origin", action="append", default=[], dest="cors_origins", metavar="ORIGIN",
                       help="a browser origin allowed to call the API, e.g. https://app.example.com (repeat; "
                            "none by default: CORS closed)")
    group.add_argument("--docs", action=argparse.BooleanOptionalAction, default=SERVER_DEFAULTS.enable_docs,
                       dest="enable_docs", help="serve the API schema at /openapi.json and Swagger UI at /docs")
    group.add_argument("--tool-call-parser", default=SERVER_DEFAULTS.tool_call_parser, choices=TOOL_CALL_PARSERS,
                       help="how tool_choice 'auto' finds tool calls in the model's text: hermes "
                            "(<tool_call>{json}</tool_call>: Qwen2.5, Qwen3, Hermes), llama3_json (a JSON object "
                            "of name and parameters: Llama 3.x), mistral ([TOOL_CALLS]); default: none, and a "
                            "request with tool_choice 'auto' is refused ('required' and a named function need "
                            "no parser)")
    group.add_argument("--max-body-bytes", type=int, default=SERVER_DEFAULTS.max_body_bytes,
                       help="request bodies larger than this get 413")
    group.add_argument("--api-processes", type=int, default=SERVER_DEFAULTS.api_processes, metavar="N",
                       help="HTTP (API) processes in front of the one engine. One API process falls behind "
                            "when it cannot write every stream every engine step (clients then get several "
                            "tokens per chunk). N > 1 (Linux): N processes share the port (SO_REUSEPORT), each "
                            "streams its own connections, and the engine runs in its own process; "
                            "--max-waiting-requests holds for the server as a whole, and /metrics from any "
                            "process sums the per-request metrics of all (the others' part up to 1 s old)")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key or envs.api_key(),
                        served_model_name=args.served_model_name, log_prompts=args.log_prompts,
                        log_requests=args.log_requests, drain_timeout_s=args.drain_timeout,
                        cors_origins=tuple(args.cors_origins), max_body_bytes=args.max_body_bytes,
                        api_processes=args.api_processes, enable_docs=args.enable_docs,
                        tool_call_parser=args.tool_call_parser)


def add_debug_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=f"print the full traceback of an error (or set {envs.DEBUG_ENV}=1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="roseray", formatter_class=HelpFormatter,
        description="roseray: a continuous-batching LLM engine with a paged KV cache, served on Ray Serve. "
                    "For the multi-replica Ray Serve app use `serve run serve_config.yaml`.")
    add_debug_arg(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,serve,bench}")

    gen = sub.add_parser("generate", help="generate text for one or more prompts, offline",
                         description="Generate text for one or more prompts with an in-process engine.",
                         formatter_class=HelpFormatter, usage="%(prog)s --prompt TEXT [--prompt TEXT ...] [options]")
    group = gen.add_argument_group("sampling")
    group.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                       help="a prompt (repeat for a batch)")
    group.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    group.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this "
                                                                "much probability mass (1 = all)")
    group.add_argument("--top-k", type=int, default=-1, help="keep only the k most likely tokens (-1 = all)")
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed (default: none)")
    group.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    add_engine_args(gen)
    add_debug_arg(gen)

    serve = sub.add_parser("serve", help="serve the OpenAI API from one engine, without Ray",
                           description="Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, "
                                       "/health, /ready, /metrics) from one engine, without Ray.",
                           formatter_class=HelpFormatter, usage="%(prog)s [--model MODEL] [--port PORT] [options]")
    add_server_args(serve)
    add_engine_args(serve)
    add_debug_arg(serve)

    sub.add_parser("bench", help="benchmarks: throughput, stream, kernels, step-overhead (bench --help)",
                   add_help=False)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def _flag_message(parser: argparse.ArgumentParser, message: str) -> str:
    """A config's message in the parser's words: `api_processes must ...` -> `--api-processes must ...`."""
    field, _, rest = message.partition(" ")
    names = {field, field.removesuffix("_s")}  # ServerConfig's drain_timeout_s is --drain-timeout
    for action in parser._actions:
        if action.dest in names and action.option_strings:
            return f"{action.option_strings[0]} {rest}"
    return message


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, (ValueError, RuntimeError, OSError)) else f"{type(error).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from roseray.bench.__main__ import main as bench_main  # its own parser per benchmark

        return bench_main(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command_parser = _subparser(parser, args.command)
    for flag, reason in REMOVED_FLAGS.items():
        if flag in unknown or any(arg.startswith(flag + "=") for arg in unknown):
            command_parser.error(f"{flag} is not supported: {reason}")
    if unknown:  # argparse would print the top-level usage; the subcommand's says more
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    debug = getattr(args, "debug", False) or envs.debug()
    try:
        engine_config = engine_config_from_args(args)
        server_config = server_config_from_args(args) if args.command == "serve" else None
    except ValueError as error:
        command_parser.error(_flag_message(command_parser, str(error)))  # exits 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args, engine_config)
        return _serve(engine_config, server_config)
    except KeyboardInterrupt:  # Ctrl-C: while generating, or re-raised by uvicorn once the server drained
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        if debug:
            raise
        print(f"roseray {args.command}: error: {_one_line(error)} (--debug for the traceback)", file=sys.stderr)
        return EXIT_RUNTIME_ERROR


def _serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    if config.api_processes > 1:
        from roseray.openai_api.api_processes import run_api_processes  # serving only

        # the engine lives in its own process whatever --engine-process says
        return run_api_processes(dataclasses.replace(engine_config, engine_process=True), config)
    from roseray.openai_api.standalone import run_standalone  # FastAPI/uvicorn only when serving

    run_standalone(engine_config, config)
    return 0


def _generate(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    from roseray.llm import LLM  # loads torch and the models: only when generating
    from roseray.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    llm = LLM(**dataclasses.asdict(engine_config))
    for prompt, output in zip(args.prompt, llm.generate(args.prompt, params)):
        completion = output.outputs[0]
        print(f"--- prompt: {prompt!r}")
        print(f"{completion.text}")
        print(f"--- {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
