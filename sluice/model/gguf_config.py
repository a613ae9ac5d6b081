"""A model's shape from a GGUF file's metadata, read as llama.cpp reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, overload

from sluice.model.gguf_file import GGUFFile, StringArray, read_gguf
from sluice.model.model_config import (
    ARCHITECTURE_BY_GGUF_NAME,
    GEMMA_ARCHITECTURES,
    ModelConfig,
    checked_rotary_dim,
    is_number,
    layer_windows,
)

_CHECKED_TOKEN_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "eot", "unknown", "padding"))
# Sizes past this fit no kernel's int (and no machine's memory).
_MAX_COUNT = 2**31 - 1


class _Metadata:
    """A GGUF file's metadata, each value checked for the kind of thing its key holds: a
    value of the wrong kind is a ValueError naming the key, not a TypeError from deep in
    the model's set-up."""

    def __init__(self, reader: GGUFFile, path: Path):
        self.fields, self.file_name = reader.fields, path.name

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def count(self, key: str, default: int | None = None, zero: bool = False) -> int:
        """A shape field: there, or its default; one value for every layer (a per-layer array
        of equal values, which llama.cpp also takes, counts as one). zero: 0 may stand for
        none (and a missing key without a default reads as 0)."""
        value = self.get(key, default)
        if value is None and zero:
            return 0
        if value is None:
            raise ValueError(f"{self.file_name}: {key} is missing")
        if isinstance(value, list) and value and all(is_number(item) for item in value):
            if len(set(value)) != 1:
                raise ValueError(f"{self.file_name}: {key} differs between layers ({value}); sluice takes one for all")
            value = value[0]
        least = 0 if zero else 1
        if not is_number(value) or not least <= value <= _MAX_COUNT or value != int(value):
            raise ValueError(
                f"{self.file_name}: {key} must be a whole number from {least} to {_MAX_COUNT:,}, got {value!r}"
            )
        return int(value)

    @overload
    def number(self, key: str, default: float) -> float: ...
    @overload
    def number(self, key: str, default: float | None = None) -> float | None: ...
    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.get(key, default)
        if value is not None and not is_number(value):
            raise ValueError(f"{self.file_name}: {key} must be a number, got {value!r}")
        return None if value is None else float(value)


def config_from_gguf(path: Path) -> ModelConfig:
    reader = read_gguf(path)
    metadata = _Metadata(reader, path)
    count, number = metadata.count, metadata.number

    arch_name = metadata.get("general.architecture")
    architecture = ARCHITECTURE_BY_GGUF_NAME.get(arch_name)
    if architecture is None:
        raise ValueError(
            f"GGUF architecture {arch_name!r} is not supported; supported: {sorted(ARCHITECTURE_BY_GGUF_NAME)}"
        )

    tensor_names = {tensor.name for tensor in reader.tensors}
    hidden_size = count(f"{arch_name}.embedding_length")
    num_heads = count(f"{arch_name}.attention.head_count")
    head_dim = count(f"{arch_name}.attention.key_length", hidden_size // num_heads)
    if count(f"{arch_name}.attention.value_length", head_dim) != head_dim:
        raise ValueError(
            f"{path.name}: attention.value_length differs from key_length {head_dim}; sluice takes them equal"
        )
    rotary_dims_key = f"{arch_name}.rope.dimension_count"
    rotary_dim = checked_rotary_dim(
        count(rotary_dims_key) if metadata.get(rotary_dims_key) is not None else None, head_dim
    )
    num_layers = count(f"{arch_name}.block_count")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, StringArray) or not tokens:
        raise ValueError(f"{path.name}: tokenizer.ggml.tokens must be a list of strings, got {tokens!r:.40}")
    # The special tokens transformers builds the tokenizer with (it would fail on one outside
    # the vocabulary, blaming the tokenizer) and the ends of an answer are among the tokens.
    # Others (cls, mask, fim_*, ...) go unused, as llama.cpp leaves an out-of-range one.
    for key in _CHECKED_TOKEN_KEYS:
        token_id = metadata.get(key)
        if token_id is None:
            continue
        if not is_number(token_id) or not 0 <= token_id < len(tokens) or token_id != int(token_id):
            raise ValueError(f"{path.name}: {key} must be a token id below {len(tokens)}, got {token_id!r}")
    eos_token_ids = [
        int(token_id)
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if (token_id := metadata.get(key)) is not None
    ]
    sliding_window = metadata.count(
        f"{arch_name}.attention.sliding_window", 4096 if architecture == "Gemma2ForCausalLM" else None, zero=True
    )
    return ModelConfig(
        architecture=architecture,
        vocab_size=len(tokens),
        hidden_size=hidden_size,
        intermediate_size=count(f"{arch_name}.feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=count(f"{arch_name}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope_theta=number(f"{arch_name}.rope.freq_base", 10000.0),
        rope_scaling=_gguf_rope_scaling(metadata, arch_name, reader),
        rms_norm_eps=number(f"{arch_name}.attention.layer_norm_rms_epsilon", 1e-5),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        context_len=count(f"{arch_name}.context_length", 2048),
        eos_token_ids=list(dict.fromkeys(eos_token_ids)),
        rotary_dim=rotary_dim,
        layer_windows=layer_windows(
            architecture,
            num_layers,
            sliding_window or None,
            metadata.get(f"{arch_name}.attention.sliding_window_pattern"),
        ),
        **(_gemma_gguf_fields(metadata, arch_name, architecture, num_layers, hidden_size, num_heads)),
    )


def _gemma_gguf_fields(
    metadata: _Metadata, arch_name: str, architecture: str, num_layers: int, hidden_size: int, num_heads: int
) -> dict[str, Any]:
    """Gemma's ModelConfig fields from a GGUF, read as llama.cpp reads them: its converter
    stores norm weights as 1 + w already, and the 27 B models (46 or 62 layers) scale
    scores by hidden / heads instead of head_dim."""
    if architecture not in GEMMA_ARCHITECTURES:
        return {}
    big = (architecture, num_layers) in (("Gemma2ForCausalLM", 46), ("Gemma3ForCausalLM", 62))
    gemma2 = architecture == "Gemma2ForCausalLM"
    return dict(
        mlp_activation="gelu_tanh",
        sandwich_norms=True,
        embedding_multiplier=hidden_size**0.5,
        query_pre_attn_scalar=hidden_size / num_heads if big else None,
        # Gemma 2 files written before llama.cpp stored the caps lack them: its defaults.
        attn_logit_softcap=metadata.number(f"{arch_name}.attn_logit_softcapping", 50.0 if gemma2 else None),
        final_logit_softcap=metadata.number(f"{arch_name}.final_logit_softcapping", 30.0 if gemma2 else None),
        local_rope_theta=_gemma_local_rope_theta(metadata, arch_name, architecture),
    )


def _gemma_local_rope_theta(metadata: _Metadata, arch_name: str, architecture: str) -> float | None:
    """The RoPE base of the sliding layers, as llama.cpp reads it: rope.freq_base_swa, else
    10,000 for Gemma 3 and the global base for Gemma 2 (None: the global base)."""
    local = metadata.number(f"{arch_name}.rope.freq_base_swa")
    if architecture == "Gemma3ForCausalLM":
        return local if local is not None else 10000.0
    if local is None or local == metadata.number(f"{arch_name}.rope.freq_base", 10000.0):
        return None
    return local


def _gguf_rope_scaling(metadata: _Metadata, arch_name: str, reader: GGUFFile) -> dict[str, Any] | None:
    factors = {tensor.name: tensor for tensor in reader.tensors if tensor.name.startswith("rope_factors_")}
    if "rope_factors_long.weight" in factors and "rope_factors_short.weight" in factors:
        # Phi-3's LongRoPE, as llama.cpp's converter writes it: the factors as tensors.
        original = metadata.count(f"{arch_name}.rope.scaling.original_context_length")
        return {
            "rope_type": "longrope",
            "original_max_position_embeddings": original,
            "factor": metadata.count(f"{arch_name}.context_length") / original,
            "attention_factor": metadata.number(f"{arch_name}.rope.scaling.attn_factor"),
            "long_factor": [float(x) for x in factors["rope_factors_long.weight"].data],
            "short_factor": [float(x) for x in factors["rope_factors_short.weight"].data],
        }
    frequency_factors = next((tensor for tensor in reader.tensors if tensor.name == "rope_freqs.weight"), None)
    if frequency_factors is not None:
        # Llama 3.x: llama.cpp's converter bakes the llama3 scaling into one divisor per
        # rotary frequency (inv_freq / factor).
        return {"rope_type": "frequency_factors", "factors": [float(x) for x in frequency_factors.data]}
    key = f"{arch_name}.rope.scaling."
    scaling_type = metadata.get(key + "type", "linear")  # llama.cpp's default
    if scaling_type == "yarn":
        return _gguf_yarn(metadata, arch_name)
    if scaling_type == "none":
        return None
    if scaling_type == "longrope":
        raise ValueError(f"{key}type is longrope but the file has no rope_factors_long and rope_factors_short tensors")
    if scaling_type != "linear":
        raise ValueError(f"{key}type {scaling_type!r} is not supported; supported: none, linear, yarn, longrope")
    # And its old name.
    factor = metadata.number(key + "factor") or metadata.number(f"{arch_name}.rope.scale_linear") or 1.0
    return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}


def _gguf_yarn(metadata: _Metadata, arch_name: str) -> dict[str, Any]:
    """YaRN as transformers' rope_parameters, from the keys llama.cpp's converter writes. An
    attention factor the file gives replaces YaRN's own, as in transformers (llama.cpp
    computes its own regardless)."""
    key = f"{arch_name}.rope.scaling."
    for name, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0), ("attn_factor", 1.0)):
        value = metadata.number(key + name)
        if value is not None and value != neutral:
            raise ValueError(f"{key}{name} {value:g} is not supported with YaRN (only {neutral:g})")
    factor = metadata.number(key + "factor")
    if factor is None:
        raise ValueError(f"{key}type is yarn but {key}factor is missing")
    original_key = key + "original_context_length"
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": metadata.count(
            original_key if metadata.get(original_key) else f"{arch_name}.context_length"
        ),
    }
    for name, hf_name in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        if (value := metadata.number(key + name)) is not None:
            scaling[hf_name] = value
    return scaling
