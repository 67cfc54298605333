"""Reading a Hugging Face config.json: the pieces every model module's `config_fields`
shares (RoPE parameters, per-layer attention kinds, quantization), so each architecture's
parser says only what is its own."""

from __future__ import annotations

from typing import Any

from roseray.layers.rotary import SUPPORTED_ROPE_TYPES

# quantization_config.quant_method values roseray loads for every model; a model's
# own formats (gpt-oss's mxfp4 experts) are named by its registry entry's supported_quantization.
SUPPORTED_QUANTIZATION: tuple[str, ...] = ("fp8", "compressed-tensors")  # fp8_checkpoint.py


def first(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first key that is set (not None)."""
    return next((hf[k] for k in keys if hf.get(k) is not None), default)


def decoder_geometry(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every Llama-style config.json spells the same way: vocabulary,
    widths, layer and head counts (head_dim defaults to hidden / heads, KV heads to heads)."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"],
    )


def rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either the transformers 5 `rope_parameters`
    or the older top-level `rope_theta` + `rope_scaling`."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if "full_attention" in params or "sliding_attention" in params:  # per layer kind (Gemma 3): the global one
        params = dict(params.get("full_attention") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", 1.0) != 1.0 or hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are unsupported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return theta, (None if kind == "default" else {**params, "rope_type": kind})


def layer_types(hf: dict[str, Any], num_layers: int, sliding_window: int | None) -> tuple[str, ...]:
    """Per-layer "full_attention" / "sliding_attention" from config.json's `layer_types`;
    without it, every layer slides when a window is set, else none does."""
    kinds = hf.get("layer_types")
    if kinds:
        kinds = tuple(kinds)
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}; supported: full_attention, sliding_attention")
        if len(kinds) != num_layers:
            raise ValueError(f"layer_types names {len(kinds)} layers; the model has {num_layers}")
        if "sliding_attention" in kinds and not sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return kinds
    return ("sliding_attention",) * num_layers if sliding_window else ()


def check_quantization(hf: dict[str, Any], model_supported: tuple[str, ...] = ()) -> None:
    """One line naming a quantization method roseray does not implement for this model."""
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method and method not in SUPPORTED_QUANTIZATION + model_supported:
        supported = ", ".join(SUPPORTED_QUANTIZATION + model_supported) or "none"
        raise ValueError(f"unsupported quantization method {method!r} in config.json; roseray loads: {supported}")
