"""The shape of a model, read from a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from sluice.model.gguf_header import read_architecture

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# Gemma 2 and 3: (1 + w) norms, on the attention and MLP outputs too, GeGLU, embeddings
# scaled by sqrt(hidden), sliding-window layers interleaved with global ones.
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Vision-language architectures: a vision tower and projector in front of one of the above.
SUPPORTED_VLM_ARCHITECTURES = ("LlavaForConditionalGeneration",)
# Vision-language checkpoints whose language model alone is served (requests with images are
# refused): Gemma 3 4 B and up are published only in this form.
TEXT_OF_VLM_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}

# GGUF `general.architecture` and HF `model_type` values, mapped to the HF class name.
_ARCHITECTURE_BY_GGUF_NAME = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Every how many layers a Gemma model has a global one, where its config does not list
# them (transformers' and llama.cpp's defaults): the others attend over a sliding window.
_GEMMA_WINDOW_PATTERNS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(slots=True)
class VisionConfig:
    """The vision tower (CLIP or SigLIP ViT) and projector of a LLaVA-style model."""

    tower_type: str  # "clip" (class token, pre-layernorm) or "siglip" (neither; patch conv has a bias)
    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    projector_hidden_act: str
    projector_bias: bool
    # Hidden state(s) fed to the projector, indexed like HF `hidden_states` (0 = embeddings,
    # i = output of layer i, negative from the end); a list is concatenated on the feature axis.
    feature_layer: int | list[int]
    select_strategy: str  # "default" drops the class token, "full" keeps every token

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def has_class_token(self) -> bool:
        return self.tower_type == "clip"

    @property
    def num_image_tokens(self) -> int:
        """Positions in the prompt that one image fills."""
        # As in transformers, "default" drops the first token even when it is a patch (SigLIP).
        return self.num_patches + int(self.has_class_token) - int(self.select_strategy == "default")

    @property
    def feature_layers(self) -> list[int]:
        """`feature_layer` as a list of non-negative hidden-state indices."""
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        return [layer % (self.num_layers + 1) for layer in layers]


# What new weights loaded into a running server must share with the served ones.
_FIXED_WHILE_SERVING = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "context_len",
    "image_token_id",
)


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
    qk_norm: bool  # each q and k head is RMS-normalized before the rotation (Qwen3, Gemma 3)
    context_len: int  # max_position_embeddings
    eos_token_ids: list[int]
    # Dimensions of each q/k head that rotate (Phi-4-mini: 3/4 of them); None: all of head_dim.
    rotary_dim: int | None = None
    # Per layer, how many keys a query sees, its own included (a sliding window); None: all.
    # An empty list: every layer attends over the whole sequence.
    layer_windows: list[int | None] = dataclass_field(default_factory=list)
    # Gemma 2/3 (GEMMA_ARCHITECTURES); the defaults are every other family's.
    mlp_activation: str = "silu"  # of the gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # attention and MLP outputs are normed too, before the residual add
    norm_weight_offset: float = 0.0  # added to every norm weight at load: Gemma's HF norms scale by 1 + w
    embedding_multiplier: float | None = None  # token embeddings are scaled by it (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # scores are q.k / sqrt(this); None: head_dim
    attn_logit_softcap: float | None = None  # scores s become cap * tanh(s / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # and so do the logits
    local_rope_theta: float | None = None  # sliding-window layers' RoPE base, unscaled (Gemma 3)
    # The vision-language architecture whose language model this is (its weights are read
    # from that checkpoint, its vision tower left out); None for a causal LM's own files.
    text_of: str | None = None
    # Vision-language models only; the fields above then describe the language model.
    vision: VisionConfig | None = None
    image_token_id: int | None = None  # the placeholder token an image stands for in a prompt

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def sliding_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def num_image_tokens(self) -> int:
        """Prompt positions one image fills; 0 for a text-only model."""
        return 0 if self.vision is None else self.vision.num_image_tokens

    def replacement_mismatch(self, new: ModelConfig) -> str | None:
        """Why weights of shape `new` cannot replace this model's in a running server (None:
        they can): they must fit the same KV cache, token ids and limits."""
        for name in _FIXED_WHILE_SERVING:
            served, offered = getattr(self, name), getattr(new, name)
            if served != offered:
                return f"its {name} is {offered!r}, the served model's is {served!r}"
        if (self.vision is None) != (new.vision is None):
            return "one of the two models has a vision tower and the other has none"
        return None

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """Read the config of a `.gguf` file or of a folder holding `config.json`."""
        path = Path(path)
        if path.suffix == ".gguf":
            return _from_gguf(path)
        if (path / "config.json").is_file():
            return _from_hf_folder(path)
        raise FileNotFoundError(f"model path {str(path)!r} is neither a .gguf file nor a folder with config.json")


def check_servable(path: str | Path) -> None:
    """Refuse a model this server cannot load, with one line naming what is wrong (a missing
    path, an unsupported architecture), before any process starts. Cheap: a GGUF's first
    metadata or a folder's config.json."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model path {str(path)!r}: no such file")
        arch_name = read_architecture(path)
        if arch_name not in _ARCHITECTURE_BY_GGUF_NAME:
            supported = sorted(_ARCHITECTURE_BY_GGUF_NAME)
            raise ValueError(f"{path}: GGUF architecture {arch_name!r} is not supported; supported: {supported}")
        return
    ModelConfig.from_path(path)


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
        raise ValueError(
            f"GGUF architecture {arch_name!r} is not supported; supported: {sorted(_ARCHITECTURE_BY_GGUF_NAME)}"
        )

    tensor_names = {tensor.name for tensor in reader.tensors}
    hidden_size = int(field(f"{arch_name}.embedding_length"))
    num_heads = int(field(f"{arch_name}.attention.head_count"))
    head_dim = int(field(f"{arch_name}.attention.key_length", hidden_size // num_heads))
    rotary_dims = field(f"{arch_name}.rope.dimension_count")
    rotary_dim = _checked_rotary_dim(None if rotary_dims is None else int(rotary_dims), head_dim)
    num_layers = int(field(f"{arch_name}.block_count"))
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
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(field(f"{arch_name}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(field(f"{arch_name}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(field, arch_name, reader),
        rms_norm_eps=float(field(f"{arch_name}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        context_len=int(field(f"{arch_name}.context_length", 2048)),
        eos_token_ids=list(dict.fromkeys(eos_token_ids)),
        rotary_dim=rotary_dim,
        layer_windows=_layer_windows(
            architecture,
            num_layers,
            field(f"{arch_name}.attention.sliding_window") or None,
            field(f"{arch_name}.attention.sliding_window_pattern"),
        ),
        **(_gemma_gguf_fields(field, arch_name, architecture, num_layers, hidden_size, num_heads)),
    )


def _gemma_gguf_fields(
    field, arch_name: str, architecture: str, num_layers: int, hidden_size: int, num_heads: int
) -> dict[str, Any]:
    """Gemma's ModelConfig fields from a GGUF, read as llama.cpp reads them: its converter
    stores norm weights as 1 + w already, and the 27 B models (46 or 62 layers) scale
    scores by hidden / heads instead of head_dim."""
    if architecture not in GEMMA_ARCHITECTURES:
        return {}
    big = (architecture, num_layers) in (("Gemma2ForCausalLM", 46), ("Gemma3ForCausalLM", 62))
    return dict(
        mlp_activation="gelu_tanh",
        sandwich_norms=True,
        embedding_multiplier=hidden_size**0.5,
        query_pre_attn_scalar=hidden_size / num_heads if big else None,
        attn_logit_softcap=field(f"{arch_name}.attn_logit_softcapping"),
        final_logit_softcap=field(f"{arch_name}.final_logit_softcapping"),
        local_rope_theta=10000.0 if architecture == "Gemma3ForCausalLM" else None,
    )


def _layer_windows(
    architecture: str, num_layers: int, sliding_window: int | None, pattern: Any, layer_types: list[str] | None = None
) -> list[int | None]:
    """Each layer's sliding window (None: global), from a config's `layer_types`, else a GGUF's
    `sliding_window_pattern` (every how many layers one is global, or a bool per layer,
    True = sliding), else the architecture's default: Gemma's interleaving, every layer
    for the rest (Mistral v0.1)."""
    if sliding_window is None:
        return []
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, not num_hidden_layers = {num_layers}")
        sliding = [kind == "sliding_attention" for kind in layer_types]
    elif isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern][:num_layers]
    else:
        every = int(pattern or _GEMMA_WINDOW_PATTERNS.get(architecture, 0))
        sliding = [every == 0 or (layer + 1) % every != 0 for layer in range(num_layers)]
    return [int(sliding_window) if flag else None for flag in sliding] if any(sliding) else []


def _checked_rotary_dim(rotary_dim: int | None, head_dim: int) -> int | None:
    """None when every dimension of a head rotates; a ValueError for a count the rotation
    cannot take (odd, zero or more than head_dim)."""
    if rotary_dim is None or rotary_dim == head_dim:
        return None
    if not 0 < rotary_dim < head_dim or rotary_dim % 2:
        raise ValueError(f"a rotary dimension count of {rotary_dim} does not fit a head of {head_dim}")
    return rotary_dim


def _gguf_rope_scaling(field, arch_name: str, reader) -> dict[str, Any] | None:
    factors = {tensor.name: tensor for tensor in reader.tensors if tensor.name.startswith("rope_factors_")}
    if "rope_factors_long.weight" in factors and "rope_factors_short.weight" in factors:
        # Phi-3's LongRoPE, as llama.cpp's converter writes it: the factors as tensors.
        original = int(field(f"{arch_name}.rope.scaling.original_context_length"))
        return {
            "rope_type": "longrope",
            "original_max_position_embeddings": original,
            "factor": int(field(f"{arch_name}.context_length")) / original,
            "attention_factor": field(f"{arch_name}.rope.scaling.attn_factor"),
            "long_factor": [float(x) for x in factors["rope_factors_long.weight"].data],
            "short_factor": [float(x) for x in factors["rope_factors_short.weight"].data],
        }
    frequency_factors = next((tensor for tensor in reader.tensors if tensor.name == "rope_freqs.weight"), None)
    if frequency_factors is not None:
        # Llama 3.x: llama.cpp's converter bakes the llama3 scaling into one divisor per
        # rotary frequency (inv_freq / factor).
        return {"rope_type": "frequency_factors", "factors": [float(x) for x in frequency_factors.data]}
    if field(f"{arch_name}.rope.scaling.type") != "linear":
        return None
    return {"rope_type": "linear", "factor": float(field(f"{arch_name}.rope.scaling.factor", 1.0))}


def _from_hf_folder(folder: Path) -> ModelConfig:
    config = json.loads((folder / "config.json").read_text())
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


def _text_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a causal LM's `config.json` (or a VLM's `text_config`)."""
    architectures = config.get("architectures") or [_ARCHITECTURE_BY_MODEL_TYPE.get(config.get("model_type", ""), "")]
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")

    # transformers 5 writes `rope_parameters` (theta included); older versions write
    # `rope_theta` and `rope_scaling` separately. Gemma 3's has one set per kind of layer.
    rope_parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
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
    partial_rotary_factor = rope_parameters.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor")
    rope_scaling = rope_parameters if rope_parameters.get("rope_type", "default") != "default" else None

    hidden_size = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden_size // num_heads
    context_len = config.get("max_position_embeddings", 2048)
    rotary_dim = None if partial_rotary_factor is None else int(head_dim * partial_rotary_factor)
    use_sliding_window = config.get("use_sliding_window", True) or config.get("layer_types") is not None
    return dict(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rotary_dim=_checked_rotary_dim(rotary_dim, head_dim),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("attention_bias", architecture == "Qwen2ForCausalLM"),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        context_len=context_len,
        layer_windows=_layer_windows(
            architecture,
            config["num_hidden_layers"],
            config.get("sliding_window") if use_sliding_window else None,
            config.get("sliding_window_pattern"),
            config.get("layer_types"),
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
        sources.append(json.loads(generation_config_path.read_text()))
    eos_token_ids: list[int] = []
    for source in sources:
        eos = source.get("eos_token_id")
        eos_token_ids.extend([eos] if isinstance(eos, int) else eos or [])
    return list(dict.fromkeys(eos_token_ids))
