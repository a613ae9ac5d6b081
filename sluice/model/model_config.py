"""The shape of a model, read from a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

# GGUF `general.architecture` and HF `model_type` values, mapped to the HF class name.
_ARCHITECTURE_BY_GGUF_NAME = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # HF format, with "rope_type"; None for plain RoPE
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    context_len: int  # max_position_embeddings
    eos_token_ids: list[int]

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """Read the config of a `.gguf` file or of a folder holding `config.json`."""
        path = Path(path)
        if path.suffix == ".gguf":
            return _from_gguf(path)
        if (path / "config.json").is_file():
            return _from_hf_folder(path)
        raise FileNotFoundError(f"model path {str(path)!r} is neither a .gguf file nor a folder with config.json")


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"


@functools.lru_cache(maxsize=1)
def open_gguf(path: str):
    """A `gguf.GGUFReader` for `path`, shared by config and weight loading.

    Building one parses every tokenizer array entry (about 5 s for a 49k vocabulary), so the
    config read and the weight load that follows it reuse the same reader.
    """
    import gguf

    return gguf.GGUFReader(path)


def _from_gguf(path: Path) -> ModelConfig:
    reader = open_gguf(str(path))

    def field(key: str, default: Any = None) -> Any:
        found = reader.fields.get(key)
        return default if found is None else found.contents()

    arch_name = field("general.architecture")
    architecture = _ARCHITECTURE_BY_GGUF_NAME.get(arch_name)
    if architecture is None:
        raise ValueError(f"GGUF architecture {arch_name!r} is not supported; supported: {sorted(_ARCHITECTURE_BY_GGUF_NAME)}")

    tensor_names = {tensor.name for tensor in reader.tensors}
    hidden_size = int(field(f"{arch_name}.embedding_length"))
    num_heads = int(field(f"{arch_name}.attention.head_count"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    eos_token_ids = [
        int(token_id)
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if (token_id := field(key)) is not None
    ]
    return ModelConfig(
        architecture=architecture,
        vocab_size=len(tokens.data),
        hidden_size=hidden_size,
        intermediate_size=int(field(f"{arch_name}.feed_forward_length")),
        num_layers=int(field(f"{arch_name}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(field(f"{arch_name}.attention.head_count_kv", num_heads)),
        head_dim=int(field(f"{arch_name}.attention.key_length", hidden_size // num_heads)),
        rope_theta=float(field(f"{arch_name}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(field, arch_name),
        rms_norm_eps=float(field(f"{arch_name}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        context_len=int(field(f"{arch_name}.context_length", 2048)),
        eos_token_ids=list(dict.fromkeys(eos_token_ids)),
    )


def _gguf_rope_scaling(field, arch_name: str) -> dict[str, Any] | None:
    # Only linear scaling is described by metadata; llama3-style scaling is baked into a
    # `rope_freqs` tensor by llama.cpp and is not read here.
    if field(f"{arch_name}.rope.scaling.type") != "linear":
        return None
    return {"rope_type": "linear", "factor": float(field(f"{arch_name}.rope.scaling.factor", 1.0))}


def _from_hf_folder(folder: Path) -> ModelConfig:
    config = json.loads((folder / "config.json").read_text())
    architectures = config.get("architectures") or [_ARCHITECTURE_BY_MODEL_TYPE.get(config.get("model_type"), "")]
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")

    # transformers 5 writes `rope_parameters` (theta included); older versions write
    # `rope_theta` and `rope_scaling` separately.
    rope_parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_theta = float(config.get("rope_theta") or rope_parameters.pop("rope_theta", None) or 10000.0)
    rope_parameters.pop("rope_theta", None)
    if "type" in rope_parameters:
        rope_parameters.setdefault("rope_type", rope_parameters.pop("type"))
    rope_scaling = rope_parameters if rope_parameters.get("rope_type", "default") != "default" else None

    hidden_size = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    return ModelConfig(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden_size // num_heads,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("attention_bias", architecture == "Qwen2ForCausalLM"),
        context_len=config.get("max_position_embeddings", 2048),
        eos_token_ids=_hf_eos_token_ids(folder, config),
    )


def _hf_eos_token_ids(folder: Path, config: dict[str, Any]) -> list[int]:
    """Union of the eos ids in config.json and generation_config.json, in that order."""
    sources = [config]
    generation_config_path = folder / "generation_config.json"
    if generation_config_path.is_file():
        sources.append(json.loads(generation_config_path.read_text()))
    eos_token_ids: list[int] = []
    for source in sources:
        eos = source.get("eos_token_id")
        eos_token_ids.extend([eos] if isinstance(eos, int) else eos or [])
    return list(dict.fromkeys(eos_token_ids))
