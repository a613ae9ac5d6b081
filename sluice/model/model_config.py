"""The shape of a model (ModelConfig), read from a GGUF file (gguf_config.py) or a Hugging Face
folder (hf_config.py), and what both readers share."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, TypeGuard

from sluice.model.gguf_file import read_architecture
from sluice.model.safetensors_files import check_safetensors

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

# GGUF `general.architecture` values, mapped to the HF class name.
ARCHITECTURE_BY_GGUF_NAME = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Every how many layers a Gemma model has a global one, where its config does not list
# them (transformers' and llama.cpp's defaults): the others attend over a sliding window.
_GEMMA_WINDOW_PATTERNS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}


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

    def __post_init__(self) -> None:
        """Refuse numbers no model has, naming the field: such a model would load, pass its
        shape checks and answer garbage (NaN logits become token 0) or fail every step."""
        for name in _POSITIVE_COUNTS:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"the model's {name} is {value!r}: it must be a positive whole number")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"the model's num_heads {self.num_heads} is not a multiple of its num_kv_heads {self.num_kv_heads}"
            )
        for name in ("rope_theta", "rms_norm_eps", "local_rope_theta", "query_pre_attn_scalar", "embedding_multiplier"):
            value = getattr(self, name)
            if value is not None and not is_positive_number(value):
                raise ValueError(f"the model's {name} is {value!r}: it must be a finite number > 0")
        for name in ("attn_logit_softcap", "final_logit_softcap"):  # 0: none
            value = getattr(self, name)
            if value is not None and not (is_positive_number(value) or value == 0):
                raise ValueError(f"the model's {name} is {value!r}: it must be a finite number >= 0")
        if bad := [token_id for token_id in self.eos_token_ids if not 0 <= token_id < self.vocab_size]:
            raise ValueError(
                f"the model's end-of-sequence token id {bad[0]} is not in its vocabulary of {self.vocab_size} "
                "(it would never end an answer)"
            )
        if (self.rotary_dim or self.head_dim) % 2:
            raise ValueError(f"the model's head_dim {self.head_dim} is odd: RoPE rotates pairs of dimensions")
        if bad_windows := [window for window in self.layer_windows if window is not None and window <= 0]:
            raise ValueError(f"the model's sliding window is {bad_windows[0]}: it must be a positive number of tokens")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, (self.rotary_dim or self.head_dim) // 2)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def sliding_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def widest_window(self) -> int | None:
        """The longest sliding window of any layer (None: no layer slides)."""
        windows = [window for window in self.layer_windows if window is not None]
        return max(windows) if windows else None

    @property
    def num_image_tokens(self) -> int:
        """Prompt positions one image fills; 0 for a text-only model."""
        return 0 if self.vision is None else self.vision.num_image_tokens

    def with_context_length(self, context_length: int) -> ModelConfig:
        """This config serving at most `context_length` tokens a request (0: the model's own)."""
        if not context_length:
            return self
        if context_length > self.context_len:
            raise ValueError(
                f"--context-length {context_length} is more than the model's context length {self.context_len}: "
                "its positions past that were never trained"
            )
        return replace(self, context_len=context_length)

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
            from sluice.model.gguf_config import config_from_gguf

            return config_from_gguf(path)
        if (path / "config.json").is_file():
            from sluice.model.hf_config import config_from_hf_folder

            return config_from_hf_folder(path)
        raise FileNotFoundError(f"model path {str(path)!r} is neither a .gguf file nor a folder with config.json")


_POSITIVE_COUNTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "context_len",
)


def check_servable(path: str | Path) -> None:
    """Refuse a model this server cannot load, with one line naming what is wrong (a missing
    path, an unsupported architecture, a broken weights file), before any process starts.
    Cheap: a GGUF's metadata, or a folder's config.json and safetensors headers."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model path {str(path)!r}: no such file")
        arch_name = read_architecture(path)
        if arch_name not in ARCHITECTURE_BY_GGUF_NAME:
            supported = sorted(ARCHITECTURE_BY_GGUF_NAME)
            raise ValueError(f"{path}: GGUF architecture {arch_name!r} is not supported; supported: {supported}")
    # The model's numbers before its tokenizer: transformers builds a GGUF's tokenizer from
    # the same metadata and would blame the tokenizer for a head count it cannot take.
    ModelConfig.from_path(path)
    if not is_gguf(path):
        check_safetensors(path)


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"


def layer_windows(
    architecture: str, num_layers: int, sliding_window: int | None, pattern: Any, layer_types: list[str] | None = None
) -> list[int | None]:
    """Each layer's sliding window (None: global), from a config's `layer_types`, else a GGUF's
    `sliding_window_pattern` (every how many layers one is global, or a bool per layer,
    True = sliding), else the architecture's default: Gemma's interleaving, every layer
    for the rest (Mistral v0.1)."""
    if layer_types is not None and (
        unknown := sorted({str(kind) for kind in layer_types} - {"sliding_attention", "full_attention"})
    ):
        raise ValueError(f"layer_types holds {unknown[0]!r}; sluice serves sliding_attention and full_attention layers")
    if sliding_window is None:
        return []
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, not num_hidden_layers = {num_layers}")
        sliding = [kind == "sliding_attention" for kind in layer_types]
    elif isinstance(pattern, list):
        if len(pattern) < num_layers:
            raise ValueError(f"sliding_window_pattern lists {len(pattern)} layers, fewer than the {num_layers}")
        sliding = [bool(flag) for flag in pattern][:num_layers]
    else:
        if pattern is not None and not (is_number(pattern) and pattern == int(pattern) and pattern >= 0):
            raise ValueError(f"sliding_window_pattern must be a whole number or a list of flags, got {pattern!r:.40}")
        every = int(pattern or _GEMMA_WINDOW_PATTERNS.get(architecture, 0))
        sliding = [every == 0 or (layer + 1) % every != 0 for layer in range(num_layers)]
    return [int(sliding_window) if flag else None for flag in sliding] if any(sliding) else []


def is_number(value: Any) -> TypeGuard[int | float]:
    """An int or a float, not a bool (which Python counts as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_positive_number(value: Any) -> TypeGuard[int | float]:
    return is_number(value) and math.isfinite(value) and value > 0


# The RoPE scaling parameters that are numbers > 0 where given (rope_type's own), and the
# lists of them, one for each rotating pair of a head's dimensions.
ROPE_SCALING_NUMBERS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
)
ROPE_SCALING_LISTS = ("long_factor", "short_factor", "factors")


def _check_rope_scaling(rope_scaling: dict[str, Any], rotary_pairs: int) -> None:
    """ValueError naming a RoPE scaling parameter no model has: a factor of 0, NaN or inf
    divides the rotation's frequencies into NaN (the model answers token 0), a list of the
    wrong length fails every step."""
    kind = rope_scaling.get("rope_type")
    for name in ROPE_SCALING_NUMBERS:
        value = rope_scaling.get(name)
        if value is not None and not is_positive_number(value):
            raise ValueError(f"the model's rope_scaling {name} ({kind}) is {value!r}: it must be a finite number > 0")
    for name in ROPE_SCALING_LISTS:
        values = rope_scaling.get(name)
        if values is None:
            continue
        if not isinstance(values, list) or not all(is_positive_number(value) for value in values):
            raise ValueError(f"the model's rope_scaling {name} ({kind}) must be a list of finite numbers > 0")
        if len(values) != rotary_pairs:
            raise ValueError(
                f"the model's rope_scaling {name} ({kind}) has {len(values)} values: its heads rotate "
                f"{rotary_pairs} pairs of dimensions"
            )


def checked_rotary_dim(rotary_dim: int | None, head_dim: int) -> int | None:
    """None when every dimension of a head rotates; a ValueError for a count the rotation
    cannot take (odd, zero or more than head_dim)."""
    if rotary_dim is None or rotary_dim == head_dim:
        return None
    if not 0 < rotary_dim < head_dim or rotary_dim % 2:
        raise ValueError(f"a rotary dimension count of {rotary_dim} does not fit a head of {head_dim}")
    return rotary_dim
