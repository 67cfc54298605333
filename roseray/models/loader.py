"""Finding a model, reading its geometry, building it and filling its weights.

`model` strings are `random:<preset>`, a local Hugging Face directory, or a hub id already in
the local Hugging Face cache (roseray never downloads). Weights load from *.safetensors only
(single file or sharded with model.safetensors.index.json), never from pickled checkpoints.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from roseray.config import EngineConfig, ModelConfig
from roseray.distributed import tensor_parallel
from roseray.layers.activation import get_activation
from roseray.layers.norms import RMSNorm
from roseray.models import fp8_checkpoint
from roseray.models.hf_fields import check_quantization
from roseray.models.presets import is_preset, preset_config
from roseray.models.registry import SUPPORTED_ARCHITECTURES, architecture_entry, get_model_class

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------- where the model is


def resolve_model_path(model: str | Path, revision: str | None = None) -> Path | None:
    """None for a random preset, else the directory holding config.json and the weights."""
    if isinstance(model, str) and is_preset(model):
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"model path {str(model)!r} is a file; expected a Hugging Face model directory")
    if isinstance(model, Path) or path.is_absolute() or str(model).startswith((".", "~")):
        raise FileNotFoundError(f"model directory {str(model)!r} does not exist")
    return _cached_snapshot(str(model), revision)


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as exc:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local directory nor in the local Hugging Face cache; "
            f"roseray does not download models: fetch it first (e.g. `hf download {repo_id}`)"
        ) from exc


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's *.safetensors files: the shards named by the index, else
    model.safetensors, else every *.safetensors in the directory."""
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) missing from {path}: {', '.join(missing)}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {path}; roseray loads only safetensors checkpoints "
            "(never pickled .bin/.pt files): convert the checkpoint first"
        )
    return files


# ---------------------------------------------------------------- geometry


def load_model_config(model: str, revision: str | None = None, load_format: str = "auto") -> ModelConfig:
    """The geometry of `model`; with load_format "dummy" its directory needs no weights."""
    if is_preset(model):
        return preset_config(model)
    path = resolve_model_path(model, revision)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face model directory?")
    hf_config = json.loads(config_file.read_text())
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    model_config = model_config_from_hf(hf_config, generation)
    if load_format != "dummy":
        safetensors_files(path)  # fail now, not after building the model
    return model_config


def resolve_max_model_len(model_config: ModelConfig, config: EngineConfig) -> int:
    """EngineConfig.max_model_len, or the model's max positions; past them is an error."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit}")
    return config.max_model_len


def model_config_from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Normalise a config.json (and generation_config.json) into a ModelConfig."""
    hf_architecture = _architecture(hf)
    entry = architecture_entry(hf_architecture)
    check_quantization(hf, entry.supported_quantization)
    fp8_checkpoint.checkpoint_fp8_scheme(hf)  # an fp8 format roseray cannot read: fail now
    fields = entry.config_fields(hf, hf_architecture)
    get_activation(fields["hidden_act"])  # unsupported activation: fail early
    return ModelConfig(
        architecture=entry.family,
        hf_architecture=hf_architecture,
        eos_token_ids=_eos_token_ids(hf, generation or {}),
        torch_dtype=_DTYPE_NAMES.get(str(hf.get("torch_dtype") or hf.get("dtype"))),
        hf_config=hf,
        **fields,
    )


def _architecture(hf: dict[str, Any]) -> str:
    names = hf.get("architectures") or []
    if not names:
        raise ValueError(f"config.json names no architectures; roseray supports: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return next((name for name in names if name in SUPPORTED_ARCHITECTURES), names[0])


def _eos_token_ids(hf: dict[str, Any], generation: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for source in (hf.get("eos_token_id"), generation.get("eos_token_id")):
        for token_id in source if isinstance(source, list) else [source]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return ids


# ---------------------------------------------------------------- building and weights


def load_model(
    model_config: ModelConfig,
    model_path_or_preset: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    load_format: str = "auto",
    quantization: str | None = None,
) -> nn.Module:
    """Build the model on `device` in `dtype` and fill its weights: seeded random ones for a
    `random:` preset or load_format "dummy", else the checkpoint's safetensors. An fp8
    checkpoint loads as fp8; `quantization="fp8"` quantizes the other weights after loading
    (fp8_checkpoint.py). The model's `kv_cache_scales` holds the checkpoint's K/V scales
    ({layer: {"k": s, "v": s}}, empty without). Returned in eval mode."""
    device = torch.device(device)
    scheme = fp8_checkpoint.checkpoint_fp8_scheme(model_config.hf_config)
    check_tensor_parallel(model_config, scheme is not None and load_format != "dummy")
    model = build_model(model_config, device, dtype)
    path = resolve_model_path(model_path_or_preset)
    if scheme is not None or quantization == "fp8":
        fp8_checkpoint.check_fp8_device(device)
    model.kv_cache_scales = {}
    if path is None or load_format == "dummy":
        if path is not None:
            logger.info("load_format dummy: random weights in the geometry of %s", path)
        init_random_weights(model, seed)
        if scheme is not None or quantization == "fp8":
            _log_fp8("random weights", fp8_checkpoint.quantize_linears(model), model_config)
    elif scheme is not None:
        count = fp8_checkpoint.install_fp8_shells(model, scheme)
        tensors = iterate_safetensors(safetensors_files(path), device)
        model.load_weights(fp8_checkpoint.checkpoint_tensors(tensors, scheme, model.kv_cache_scales))
        fp8_checkpoint.finalize_fp8(model)
        _log_fp8(f"the checkpoint ({scheme.method}, {scheme.scale_format} scales)", count, model_config)
    else:
        model.load_weights(iterate_safetensors(safetensors_files(path), device))
        if quantization == "fp8":
            _log_fp8("the checkpoint, quantized at load", fp8_checkpoint.quantize_linears(model), model_config)
    if scheme is not None or quantization == "fp8":
        fp8_checkpoint.link_fp8_norms(model)
    return model.eval()


# model families whose layers shard across a tensor-parallel group (roseray.layers.tensor_parallel; MoE
# experts: roseray.layers.moe); GPT-2 does not
TENSOR_PARALLEL_FAMILIES = ("llama", "qwen3_moe", "mixtral", "gpt_oss", "gemma", "phi3")


def check_tensor_parallel(model_config: ModelConfig, fp8_checkpoint_weights: bool) -> None:
    size = tensor_parallel().size
    if size == 1:
        return
    if model_config.architecture not in TENSOR_PARALLEL_FAMILIES:
        raise ValueError(f"tensor_parallel_size {size}: {model_config.hf_architecture} does not shard yet; tensor "
                         "parallelism runs the Llama family (Llama, Qwen2, Qwen3, Mistral), Qwen3-MoE, Mixtral, "
                         "gpt-oss, Gemma 2/3 and Phi-3")
    if fp8_checkpoint_weights:
        raise ValueError(f"tensor_parallel_size {size} with an fp8 checkpoint is unsupported; load the bf16 "
                         "checkpoint with quantization: fp8 (each rank quantizes its shard)")


def _log_fp8(source: str, count: int, model_config: ModelConfig) -> None:
    experts = ", MoE experts included" if model_config.moe is not None else ""
    logger.info("fp8 weights from %s: %d layers in e4m3 with a scale per output channel%s (lm_head, "
                "embeddings, norms and routers in the model's dtype)", source, count, experts)


def build_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Instantiate directly on `device` with `dtype` parameters (RoPE tables stay fp32)."""
    model_class = get_model_class(model_config)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(model_config)
    finally:
        torch.set_default_dtype(previous_dtype)


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic init on the model's device: matrices (any parameter of 2 or more
    dimensions, e.g. stacked expert weights) N(0, std), norm weights 1, every other vector
    (biases, attention sinks) 0. A module with its own rule for a parameter names it in
    `random_init` ({parameter leaf name: fill value})."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        fills = getattr(module, "random_init", {})
        for name, param in module.named_parameters(recurse=False):
            if name in fills:
                param.fill_(fills[name])
            elif isinstance(module, (nn.LayerNorm, RMSNorm)) and name == "weight":
                param.fill_(1.0)
            elif param.dim() >= 2:
                param.normal_(0.0, std, generator=generator)
            else:
                param.zero_()


def iterate_safetensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, read straight onto `device`."""
    target = str(device) if device.type == "cuda" else "cpu"
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard"):
        with safe_open(file, framework="pt", device=target) as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)
