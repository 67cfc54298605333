"""Every knob of roseray in one place: the engine's, the server's and the model's configuration.

EngineConfig is what a user sets for the engine (the engine args of `LLM(...)`, the CLI
flags and serve_config.yaml's `engine:` all map onto it). ServerConfig is what a user sets
for the OpenAI server (`roseray serve`'s flags, the Ray app's args); the CLI, the standalone
server, its API processes and the Ray deployments build it once and pass it down. ModelConfig
is what a checkpoint says about its geometry; it is read once by the loader and passed down
to the model and the runner. Environment variables are read in roseray/envs.py, not here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

# How weights load: from the checkpoint's safetensors ("auto" and "safetensors" are the same
# today), or "dummy": seeded random weights in the checkpoint's geometry (config.json and
# tokenizer files suffice), to benchmark large models without their weights on disk.
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "half": torch.float16,
    "float": torch.float32,
}


# engine arguments that other engines take and roseray refuses, with the reason
REMOVED_ENGINE_ARGS = {
    "trust_remote_code": "roseray runs only its own model code, never a checkpoint's: remove it",
}


# the <think>...</think> reasoning of Qwen3 (tags in the output) and DeepSeek-R1 (the template opens it)
REASONING_PARSERS = ("qwen3", "deepseek_r1")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# weight quantization: fp8 = e4m3 weights with a scale per output channel (quantized at load from a
# bf16/fp16 checkpoint, or read from an fp8 checkpoint, which selects it by itself)
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: e4m3 with a scale per layer


@dataclass
class EngineConfig:
    """Engine arguments. Field names follow vLLM's so that users feel at home."""

    model: str = "random:tiny"
    tokenizer: str | None = None  # defaults to `model`
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cuda | cpu
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None  # override; otherwise sized from memory
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gib: float = 1.0  # KV budget when running on CPU
    max_model_len: int | None = None  # defaults to the model's max positions
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    attention_backend: str = "auto"  # auto | triton | torch
    max_waiting_requests: int = 1024  # queue limit per engine (serving returns 429 past it)
    max_logprobs: int = 20
    cuda_graph_max_batch_size: int = 512
    cuda_graph_max_tokens: int = 8192  # steps with prefill chunks up to this many tokens: piecewise graphs; 0 = eager
    async_scheduling: bool | None = None  # overlap host work with the GPU (default: on for CUDA)
    engine_process: bool | None = None  # serving: the engine loop in its own process (default: on for CUDA)
    revision: str | None = None
    load_format: str = "auto"  # LOAD_FORMATS: auto/safetensors read the checkpoint; dummy makes random weights
    # how the model marks its reasoning (REASONING_PARSERS): the server splits it out, and a
    # request's structured output applies from where the reasoning ends
    reasoning_parser: str | None = None
    quantization: str | None = None  # QUANTIZATIONS; None: as the checkpoint is (fp8 checkpoints load as fp8)
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    # fp8 KV: the scale of every layer's K and V (stored value = value / scale); None: the
    # checkpoint's k_scale / v_scale where it has them, else 1.0
    kv_cache_scale: float | None = None
    # one engine replica across this many GPUs (ranks 1.. are worker processes; every family but GPT-2 shards)
    tensor_parallel_size: int = 1
    # processes that hold the constrained requests' grammar matchers (None: a quarter of the cores, 1 to 4)
    grammar_workers: int | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset); "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1; got {self.tensor_parallel_size}")
        if self.grammar_workers is not None and self.grammar_workers < 1:
            raise ValueError(f"grammar_workers must be >= 1; got {self.grammar_workers}")
        if self.kv_cache_scale is not None and not self.kv_cache_scale > 0:
            raise ValueError(f"kv_cache_scale must be > 0; got {self.kv_cache_scale}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {self.reasoning_parser!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of auto, float32, float16, bfloat16; got {self.dtype!r}")
        if self.device not in ("auto", "cuda", "cpu") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cuda or cpu; got {self.device!r}")
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"attention_backend must be auto, triton or torch; got {self.attention_backend!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two; got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1; got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        if self.cuda_graph_max_tokens < 0:
            raise ValueError(f"cuda_graph_max_tokens must be >= 0 (0 = off); got {self.cuda_graph_max_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1; got {self.max_model_len}")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        """From keyword arguments (`LLM(...)`, serve_config.yaml's `engine:`), with a clear
        TypeError for a name that is not a field."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            reasons = [f"{name} ({REMOVED_ENGINE_ARGS[name]})" if name in REMOVED_ENGINE_ARGS else name
                       for name in unknown]
            raise TypeError(f"unknown engine argument(s): {', '.join(reasons)}")
        if model is not None:
            kwargs["model"] = model
        return cls(**kwargs)

    def resolve_grammar_workers(self) -> int:
        """A quarter of the host's cores, 1 to 4, unless set: beside the engine, its API processes
        and the GPU's own host threads."""
        if self.grammar_workers is not None:
            return self.grammar_workers
        return max(1, min(4, (os.cpu_count() or 2) // 4))

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"device is {self.device!r} but this machine has no usable CUDA device "
                               "(torch.cuda.is_available() is False): use device cpu or auto")
        return torch.device(self.device)

    def resolve_engine_process(self) -> bool:
        """Whether the async engine runs its loop in a child process (off the server's GIL)."""
        if self.engine_process is not None:
            return self.engine_process
        return self.resolve_device().type == "cuda"

    def resolve_dtype(self, model_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        if model_dtype in (torch.float16, torch.bfloat16):
            return model_dtype
        return torch.bfloat16


DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # a max_model_len-sized prompt as token ids is ~1 MB per 128k tokens
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


@dataclass
class ServerConfig:
    """The OpenAI server's settings, the same for `roseray serve`, its API processes and the Ray
    app's engine replicas. What the engine decides (model name, max_model_len, max_logprobs)
    is not here: the server reads it from the engine."""

    host: str = "127.0.0.1"  # the address to bind: loopback unless told otherwise
    port: int = 8000  # 0: a free port the kernel picks
    api_key: str | None = None  # bearer key required on every route but /health and /ready ("" = none)
    served_model_name: str | None = None  # the model id clients send and /v1/models lists (default: the engine's)
    log_prompts: bool = False  # log prompt text: user data, off by default
    log_requests: bool = False  # a log line per finished request (counts and times, no text)
    drain_timeout_s: float = 30.0  # on shutdown running requests get this long; new ones get 503 meanwhile
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none: CORS closed
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    api_processes: int = 1  # HTTP processes in front of one engine; N > 1 puts the engine in its own process
    stuck_after_s: float = 60.0  # health checks fail when the engine loop makes no progress this long
    log_level: str = "info"  # uvicorn's log level
    enable_docs: bool = True  # the OpenAPI schema at /openapi.json and Swagger UI at /docs
    # how `tool_choice: auto` finds tool calls in the model's text (TOOL_CALL_PARSERS); None: it is refused
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}; "
                             f"got {self.tool_call_parser!r}")
        if isinstance(self.cors_origins, str):
            raise ValueError(f"cors_origins must be a list of origins, not one string; got {self.cors_origins!r}")
        self.cors_origins = tuple(self.cors_origins)  # a list from JSON or YAML
        if not all(isinstance(origin, str) and origin for origin in self.cors_origins):
            raise ValueError(f"cors_origins must be non-empty strings; got {list(self.cors_origins)!r}")
        if not self.host:
            raise ValueError("host must be an address or a host name; got an empty string")
        self.api_key = self.api_key or None
        self.served_model_name = self.served_model_name or None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535; got {self.port}")
        if not 0 <= self.drain_timeout_s < float("inf"):
            raise ValueError(f"drain_timeout_s must be >= 0 seconds; got {self.drain_timeout_s}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1; got {self.max_body_bytes}")
        if self.api_processes < 1:
            raise ValueError(f"api_processes must be at least 1; got {self.api_processes}")
        if not 0 < self.stuck_after_s < float("inf"):
            raise ValueError(f"stuck_after_s must be > 0 seconds; got {self.stuck_after_s}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}; got {self.log_level!r}")


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP: each token goes to `top_k` of `num_experts` expert MLPs
    chosen by a router, and their outputs are summed weighted by the router's probabilities."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool = True  # the top-k probabilities rescaled to sum to 1 (Qwen3-MoE norm_topk_prob)
    sparse_layers: tuple[int, ...] | None = None  # layer indices with MoE MLPs; None = every layer


@dataclass
class ModelConfig:
    """The geometry of a checkpoint, normalised across architectures."""

    architecture: str  # the model family: "gpt2" | "llama" (Llama/Qwen2/Qwen3/Mistral) | one per other module
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    o_proj_bias: bool = False  # the attention output projection carries a bias (Llama/Qwen3 attention_bias)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss)
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: torch.dtype | None = None
    hf_architecture: str = ""  # the name in config.json, for messages
    # Per-layer attention kind: "full_attention" or "sliding_attention" (keys within the last
    # `sliding_window` positions, the query's own included); empty = every layer full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the output logits
    moe: MoEConfig | None = None
    # The checkpoint's config.json, for constants only one model module reads (e.g. gpt-oss's
    # SwiGLU limit); fields every layer shares belong above.
    hf_config: dict = field(default_factory=dict, repr=False)

    def is_sliding(self, layer_index: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_index] == "sliding_attention"
