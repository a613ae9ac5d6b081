"""A model's shape from a Hugging Face folder's config.json (and, for a vision-language
checkpoint, transformers' own config classes)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sluice.model.model_config import (
    GEMMA_ARCHITECTURES,
    ROPE_SCALING_LISTS,
    ROPE_SCALING_NUMBERS,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_VLM_ARCHITECTURES,
    TEXT_OF_VLM_ARCHITECTURES,
    ModelConfig,
    VisionConfig,
    checked_rotary_dim,
    is_number,
    is_positive_number,
    layer_windows,
)

# HF `model_type` values, mapped to the HF class name.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def config_from_hf_folder(folder: Path) -> ModelConfig:
    """ValueError naming config.json and the key for a file that is not JSON or lacks a field
    the model's shape needs."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    try:
        return _config_of(folder, config)
    except KeyError as e:
        raise ValueError(f"{path} has no {e.args[0]}, which the model's shape needs") from e


def _config_of(folder: Path, config: dict[str, Any]) -> ModelConfig:
    _check_value_kinds(config)
    architectures = config.get("architectures") or [_ARCHITECTURE_BY_MODEL_TYPE.get(config.get("model_type", ""), "")]
    if architectures[0] in SUPPORTED_VLM_ARCHITECTURES:
        return _llava_config(folder, config)
    if architectures[0] in TEXT_OF_VLM_ARCHITECTURES:
        return _text_of_vlm_config(folder, config, architectures[0])
    return ModelConfig(**_text_fields(config), eos_token_ids=_hf_eos_token_ids(folder, [config]))


def _text_of_vlm_config(folder: Path, config: dict[str, Any], architecture: str) -> ModelConfig:
    """The language model of a vision-language checkpoint. Its `text_config` often lists only
    what differs from transformers' defaults (Gemma 3's omits heads, vocabulary, RoPE bases):
    transformers' own config class fills in the rest."""
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(folder).text_config.to_dict()
    text_config["architectures"] = [TEXT_OF_VLM_ARCHITECTURES[architecture]]
    text_fields = _text_fields(text_config)
    text_fields["tie_word_embeddings"] = text_fields["tie_word_embeddings"] or config.get("tie_word_embeddings", False)
    return ModelConfig(
        **text_fields, eos_token_ids=_hf_eos_token_ids(folder, [config, text_config]), text_of=architecture
    )


_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_SHAPE_KEYS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
# The RoPE parameters each scaling needs (layers.py reads them); yarn's have defaults.
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("long_factor", "short_factor"),
}


def _check_shape_fields(config: dict[str, Any]) -> None:
    """ValueError naming a shape field that is not a positive integer (a KeyError, for the
    caller to name, when a required one is missing)."""
    for key in (*_SHAPE_KEYS, *_OPTIONAL_SHAPE_KEYS):
        value = config[key] if key in _SHAPE_KEYS else config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")


# The fields of config.json (and of its RoPE parameters) that are numbers, whole numbers,
# true/false or lists of numbers where given: another kind is refused naming the field,
# before anything computes with it (a string factor made "0.50.50.5..." of a head size).
_NUMBER_KEYS = (
    "rope_theta",
    "rms_norm_eps",
    "partial_rotary_factor",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_local_base_freq",
)
_WHOLE_NUMBER_KEYS = ("sliding_window", "original_max_position_embeddings", "max_window_layers")
_BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "use_sliding_window")
# Every RoPE parameter sluice reads that is a number (ROPE_SCALING_NUMBERS are also > 0).
_ROPE_NUMBER_KEYS = (*ROPE_SCALING_NUMBERS, "rope_theta", "mscale", "mscale_all_dim", "partial_rotary_factor")
_ROPE_LAYER_KINDS = ("full_attention", "sliding_attention")  # Gemma 3: a set of RoPE parameters for each


def _check_value_kinds(config: dict[str, Any]) -> None:
    def number(value: Any) -> bool:  # finite: an inf or NaN would overflow int() before any check
        return is_number(value) and math.isfinite(value)

    def check(where: str, key: str, value: Any, kind: str, ok: bool) -> None:
        if value is not None and not ok:
            raise ValueError(f"config.json: {where}{key} must be {kind}, got {value!r}")

    for key in _NUMBER_KEYS:
        check("", key, config.get(key), "a finite number", number(config.get(key)))
    for key in _WHOLE_NUMBER_KEYS:
        value = config.get(key)
        check("", key, value, "a whole number", isinstance(value, int) and not isinstance(value, bool))
    original = config.get("original_max_position_embeddings")
    check("", "original_max_position_embeddings", original, "a whole number > 0", original is None or original > 0)
    for key in _BOOL_KEYS:
        check("", key, config.get(key), "true or false", isinstance(config.get(key), bool))
    architectures = config.get("architectures")
    is_names = isinstance(architectures, list) and all(isinstance(name, str) for name in architectures)
    check("", "architectures", architectures, "a list of class names", is_names)
    layer_types = config.get("layer_types")
    check("", "layer_types", layer_types, "a list of layer kinds", isinstance(layer_types, list))
    rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(rope_key)
    if not isinstance(rope, dict):
        return  # _text_fields names it
    for kind, parameters in ((None, rope), *((kind, rope.get(kind)) for kind in _ROPE_LAYER_KINDS)):
        if not isinstance(parameters, dict):
            continue
        where = f"{rope_key}.{kind}." if kind else f"{rope_key}."
        for key in _ROPE_NUMBER_KEYS:
            check(where, key, parameters.get(key), "a finite number", number(parameters.get(key)))
        value = parameters.get("original_max_position_embeddings")
        is_length = is_positive_number(value) and value == int(value)
        check(where, "original_max_position_embeddings", value, "a whole number > 0", is_length)
        for key in ROPE_SCALING_LISTS:
            values = parameters.get(key)
            is_numbers = isinstance(values, list) and all(number(value) for value in values)
            check(where, key, values, "a list of finite numbers", is_numbers)


def _text_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a causal LM's `config.json` (or a VLM's `text_config`)."""
    _check_value_kinds(config)  # a VLM's text_config too
    architectures = config.get("architectures") or [_ARCHITECTURE_BY_MODEL_TYPE.get(config.get("model_type", ""), "")]
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")
    _check_shape_fields(config)

    # transformers 5 writes `rope_parameters` (theta included); older versions write
    # `rope_theta` and `rope_scaling` separately. Gemma 3's has one set per kind of layer.
    given_rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(given_rope, dict):
        raise ValueError(f"config.json: rope_scaling must be an object, got {given_rope!r}")
    rope_parameters = dict(given_rope)
    local_rope = rope_parameters.pop("sliding_attention", None)
    rope_parameters = dict(rope_parameters.pop("full_attention", None) or rope_parameters)
    rope_theta = float(config.get("rope_theta") or rope_parameters.pop("rope_theta", None) or 10000.0)
    rope_parameters.pop("rope_theta", None)
    if "type" in rope_parameters:
        rope_parameters.setdefault("rope_type", rope_parameters.pop("type"))
    if rope_parameters.get("rope_type") in ("su", "yarn") and architecture == "Phi3ForCausalLM":
        rope_parameters["rope_type"] = "longrope"  # Phi-3's older names for it
    if rope_parameters.get("rope_type") == "longrope":
        # Phi-3 keeps these at the top level; the default attention factor derives from them.
        rope_parameters.setdefault(
            "original_max_position_embeddings", config.get("original_max_position_embeddings", 4096)
        )
        rope_parameters.setdefault(
            "factor", config["max_position_embeddings"] / rope_parameters["original_max_position_embeddings"]
        )
    context_len = config.get("max_position_embeddings", 2048)
    if rope_parameters.get("rope_type") == "yarn":
        # As transformers reads it: the trained length from the top level first, then from the
        # RoPE parameters, else max_position_embeddings; the factor their ratio unless given.
        original = (
            config.get("original_max_position_embeddings")
            or rope_parameters.get("original_max_position_embeddings")
            or context_len
        )
        rope_parameters["original_max_position_embeddings"] = original
        if rope_parameters.get("factor") is None:
            rope_parameters["factor"] = context_len / original
        # As vLLM: YaRN is switched on to serve factor times the trained length.
        context_len = max(context_len, int(original * rope_parameters["factor"]))
    partial_rotary_factor = rope_parameters.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor")
    missing = [key for key in _ROPE_KEYS.get(rope_parameters.get("rope_type", ""), ()) if key not in rope_parameters]
    if missing:
        raise ValueError(f"config.json: rope_scaling of rope_type {rope_parameters['rope_type']!r} has no {missing[0]}")
    rope_scaling = rope_parameters if rope_parameters.get("rope_type", "default") != "default" else None

    hidden_size = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden_size // num_heads
    rotary_dim = None if partial_rotary_factor is None else int(head_dim * partial_rotary_factor)
    if architecture not in GEMMA_ARCHITECTURES and config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported for {architecture}; supported: silu")
    layer_types = config.get("layer_types")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and layer_types is None:
        # As transformers reads a Qwen config.json: windows only with use_sliding_window (off
        # by default), and then only in the layers from max_window_layers on.
        first_sliding = config.get("max_window_layers", 28) if config.get("use_sliding_window", False) else None
        layer_types = [
            "sliding_attention" if first_sliding is not None and layer >= first_sliding else "full_attention"
            for layer in range(config["num_hidden_layers"])
        ]
    # transformers' Llama has no sliding window, whatever its config.json says.
    use_sliding_window = architecture != "LlamaForCausalLM" and (
        config.get("use_sliding_window", True) or layer_types is not None
    )
    return dict(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rotary_dim=checked_rotary_dim(rotary_dim, head_dim),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        # transformers' defaults: Gemma ties its output to the embeddings, the others do not.
        tie_word_embeddings=config.get("tie_word_embeddings", architecture in GEMMA_ARCHITECTURES),
        attention_bias=config.get("attention_bias", architecture == "Qwen2ForCausalLM"),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        context_len=context_len,
        layer_windows=layer_windows(
            architecture,
            config["num_hidden_layers"],
            config.get("sliding_window") if use_sliding_window else None,
            config.get("sliding_window_pattern"),
            layer_types,
        ),
        **_gemma_hf_fields(config, architecture, local_rope),
    )


def _gemma_hf_fields(config: dict[str, Any], architecture: str, local_rope: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma's ModelConfig fields from its config.json (transformers' defaults where absent)."""
    if architecture not in GEMMA_ARCHITECTURES:
        return {}
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _GEMMA_ACTIVATIONS:
        raise ValueError(f"hidden_activation {activation!r} is not supported; supported: {list(_GEMMA_ACTIVATIONS)}")
    gemma2 = architecture == "Gemma2ForCausalLM"
    local_rope = local_rope or {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
    if local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.sliding_attention.rope_type {local_rope['rope_type']!r} is not supported")
    return dict(
        mlp_activation="gelu_tanh",
        sandwich_norms=True,
        norm_weight_offset=1.0,
        embedding_multiplier=config["hidden_size"] ** 0.5,
        query_pre_attn_scalar=config.get("query_pre_attn_scalar", 256),
        attn_logit_softcap=config.get("attn_logit_softcapping", 50.0 if gemma2 else None),
        final_logit_softcap=config.get("final_logit_softcapping", 30.0 if gemma2 else None),
        local_rope_theta=None if gemma2 else float(local_rope["rope_theta"]),
    )


# Old llava-hf checkpoints (llava-1.5) store only the fields that differ from these
# transformers defaults in their sub-configs.
_LLAMA_TEXT_DEFAULTS = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
_VISION_DEFAULTS = {
    "clip_vision_model": {
        "image_size": 224,
        "patch_size": 32,
        "num_channels": 3,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "layer_norm_eps": 1e-5,
        "hidden_act": "quick_gelu",
    },
    "siglip_vision_model": {
        "image_size": 224,
        "patch_size": 16,
        "num_channels": 3,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
    },
}


def _llava_config(folder: Path, config: dict[str, Any]) -> ModelConfig:
    text_config = {**_LLAMA_TEXT_DEFAULTS, **config.get("text_config", {})}
    text_fields = _text_fields(text_config)
    # transformers copies a tied text config up to the LLaVA config, and some checkpoints only set it there.
    text_fields["tie_word_embeddings"] = text_fields["tie_word_embeddings"] or config.get("tie_word_embeddings", False)
    image_token_id = config.get("image_token_id", config.get("image_token_index"))
    return ModelConfig(
        **text_fields,
        eos_token_ids=_hf_eos_token_ids(folder, [config, text_config]),
        vision=_vision_config(config),
        image_token_id=None if image_token_id is None else int(image_token_id),
    )


def _vision_config(config: dict[str, Any]) -> VisionConfig:
    vision_config = config.get("vision_config") or {}
    model_type = vision_config.get("model_type", "clip_vision_model")
    if model_type not in _VISION_DEFAULTS:
        raise ValueError(
            f"vision_config.model_type {model_type!r} is not supported; supported: {sorted(_VISION_DEFAULTS)}"
        )
    vision_config = {**_VISION_DEFAULTS[model_type], **vision_config}
    select_strategy = config.get("vision_feature_select_strategy", "default")
    if select_strategy not in ("default", "full"):
        raise ValueError(
            f"vision_feature_select_strategy {select_strategy!r} is not supported; supported: default, full"
        )
    feature_layer = config.get("vision_feature_layer", -2)
    num_hidden_states = vision_config["num_hidden_layers"] + 1
    for layer in [feature_layer] if isinstance(feature_layer, int) else feature_layer:
        if not -num_hidden_states <= layer < num_hidden_states:
            raise ValueError(f"vision_feature_layer {layer} is out of range for {num_hidden_states} hidden states")
    return VisionConfig(
        tower_type=model_type.removesuffix("_vision_model"),
        image_size=vision_config["image_size"],
        patch_size=vision_config["patch_size"],
        num_channels=vision_config["num_channels"],
        hidden_size=vision_config["hidden_size"],
        intermediate_size=vision_config["intermediate_size"],
        num_layers=vision_config["num_hidden_layers"],
        num_heads=vision_config["num_attention_heads"],
        layer_norm_eps=vision_config["layer_norm_eps"],
        hidden_act=vision_config["hidden_act"],
        projector_hidden_act=config.get("projector_hidden_act", "gelu"),
        projector_bias=config.get("multimodal_projector_bias", True),
        feature_layer=feature_layer if isinstance(feature_layer, int) else list(feature_layer),
        select_strategy=select_strategy,
    )


def _hf_eos_token_ids(folder: Path, configs: list[dict[str, Any]]) -> list[int]:
    """Union of the eos ids in `configs` (config.json and its sub-configs) and generation_config.json, in that order."""
    sources = list(configs)
    generation_config_path = folder / "generation_config.json"
    if generation_config_path.is_file():
        try:
            sources.append(json.loads(generation_config_path.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{generation_config_path} is not JSON: {e}") from None
    eos_token_ids: list[int] = []
    for source in sources:
        eos = source.get("eos_token_id") if isinstance(source, dict) else None
        given = [eos] if eos is not None and not isinstance(eos, list) else eos or []
        if not all(isinstance(token, int) and not isinstance(token, bool) for token in given):
            raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
        eos_token_ids.extend(given)
    return list(dict.fromkeys(eos_token_ids))
