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

from roseray.config import ModelConfig
from roseray.layers.activation import get_activation
from roseray.layers.norms import RMSNorm
from roseray.layers.rotary import SUPPORTED_ROPE_TYPES
from roseray.models.presets import is_preset, preset_config
from roseray.models.registry import SUPPORTED_ARCHITECTURES, architecture_family, get_model_class

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


def load_model_config(model: str, revision: str | None = None) -> ModelConfig:
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
    safetensors_files(path)  # fail now, not after building the model
    return model_config


def model_config_from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Normalise a config.json (and generation_config.json) into a ModelConfig."""
    hf_architecture = _architecture(hf)
    family = architecture_family(hf_architecture)
    fields = _gpt2_fields(hf) if family == "gpt2" else _llama_fields(hf, hf_architecture)
    get_activation(fields["hidden_act"])  # unsupported activation: fail early
    return ModelConfig(
        architecture=family,
        hf_architecture=hf_architecture,
        eos_token_ids=_eos_token_ids(hf, generation or {}),
        torch_dtype=_DTYPE_NAMES.get(str(hf.get("torch_dtype") or hf.get("dtype"))),
        **fields,
    )


def _architecture(hf: dict[str, Any]) -> str:
    names = hf.get("architectures") or []
    if not names:
        raise ValueError(f"config.json names no architectures; roseray supports: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return next((name for name in names if name in SUPPORTED_ARCHITECTURES), names[0])


def _first(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    return next((hf[k] for k in keys if hf.get(k) is not None), default)


def _gpt2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise ValueError(
            "GPT-2 variants with scale_attn_by_inverse_layer_idx or without scale_attn_weights are unsupported"
        )
    if not hf.get("tie_word_embeddings", True):
        raise ValueError("GPT-2 without tied word embeddings is unsupported")
    hidden = _first(hf, "n_embd", "hidden_size")
    heads = _first(hf, "n_head", "num_attention_heads")
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=_first(hf, "n_layer", "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=_first(hf, "n_inner", default=4 * hidden),
        max_position_embeddings=_first(hf, "n_positions", "n_ctx", "max_position_embeddings"),
        hidden_act=hf.get("activation_function", "gelu_new"),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=True,
    )


def _llama_fields(hf: dict[str, Any], hf_architecture: str) -> dict[str, Any]:
    if hf.get("mlp_bias"):
        raise ValueError(f"{hf_architecture} with mlp_bias=true is unsupported")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    rope_theta, rope_scaling = _rope(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=_max_positions(hf, hf_architecture),
        hidden_act=hf.get("hidden_act", "silu"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama/Qwen3's attention_bias covers both.
        attention_bias=hf_architecture == "Qwen2ForCausalLM" or attention_bias,
        o_proj_bias=hf_architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias,
        qk_norm=hf_architecture == "Qwen3ForCausalLM",
    )


def _rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either the transformers 5 `rope_parameters`
    or the older top-level `rope_theta` + `rope_scaling`."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", 1.0) != 1.0 or hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are unsupported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return theta, (None if kind == "default" else {**params, "rope_type": kind})


def _max_positions(hf: dict[str, Any], hf_architecture: str) -> int:
    """max_position_embeddings, capped at the sliding window where one applies: roseray's
    attention is full, which equals sliding-window attention for sequences within the window."""
    max_positions = hf["max_position_embeddings"]
    uses_window = hf_architecture == "MistralForCausalLM" or hf.get("use_sliding_window", False)
    window = hf.get("sliding_window") if uses_window else None
    if window and window < max_positions:
        logger.warning("%s uses a sliding window of %d tokens: capping max positions %d -> %d",
                       hf_architecture, window, max_positions, window)  # fmt: skip
        return window
    return max_positions


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
) -> nn.Module:
    """Build the model on `device` in `dtype` and fill its weights: seeded random ones for a
    `random:` preset, else the checkpoint's safetensors. Returned in eval mode."""
    device = torch.device(device)
    model = build_model(model_config, device, dtype)
    path = resolve_model_path(model_path_or_preset)
    if path is None:
        init_random_weights(model, seed)
    else:
        model.load_weights(iterate_safetensors(safetensors_files(path), device))
    return model.eval()


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
    """Deterministic init on the model's device: matrices N(0, std), norm weights 1, biases 0."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (nn.LayerNorm, RMSNorm)):
            module.weight.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std, generator=generator)
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter):
            bias.zero_()


def iterate_safetensors(files: list[Path], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, read straight onto `device`."""
    target = str(device) if device.type == "cuda" else "cpu"
    for file in tqdm(files, desc="Loading safetensors shards", unit="shard"):
        with safe_open(file, framework="pt", device=target) as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)
