"""Write a Hugging Face causal LM's weights as a GGUF file, laid out as llama.cpp's
`convert_hf_to_gguf.py` lays them out, so sluice's GGUF path can be checked against the same
weights loaded from the folder (and against transformers)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import gguf

# HF parameter name (after "model.layers.{i}.") -> GGUF tensor name (after "blk.{i}.").
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up in one tensor, under llama's "up" name
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Gemma's norms around the attention and MLP outputs (its "ffn_norm" is the norm before the MLP).
SANDWICH_NORM_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# llama.cpp's converter stores Gemma's norm weights as 1 + w.
GEMMA_ARCHES = {"gemma2", "gemma3"}
# llama.cpp interleaves the rotary halves of each Q/K head of these architectures.
PERMUTED_QK = {"llama"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        layer, part = stem.removeprefix("model.layers.").split(".", 1)
        names = {**LAYER_NAMES, **SANDWICH_NORM_NAMES} if arch in GEMMA_ARCHES else LAYER_NAMES
        return f"blk.{layer}.{names[part]}.{suffix}"
    return f"{TOP_NAMES[stem]}.{suffix}"


def _interleave_rotary_halves(array: np.ndarray, num_heads: int) -> np.ndarray:
    head_dim = array.shape[0] // num_heads
    return array.reshape(num_heads, 2, head_dim // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


# Where each block type keeps its float16 scales, as byte offsets in the block: a random
# block gets finite scales there (random bytes could make them inf or NaN).
_SCALE_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
}


def random_blocks(rows: int, columns: int, type_name: str, seed: int, scale: float = 1e-3) -> np.ndarray:
    """uint8 [rows, bytes per row]: a matrix of random `type_name` blocks whose float16 scales
    lie in [scale / 2, scale] (gguf-py cannot quantize to K-quants; these stand in for them)."""
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * columns // block_weights, block_bytes), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[type_name]:
        scales = rng.uniform(scale / 2, scale, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_gguf(
    model: torch.nn.Module,
    path: Path,
    arch: str,
    quantize_matrices: str | None = None,
    raw_matrices: dict[str, tuple[np.ndarray, str]] | None = None,
    metadata: dict[str, str | float | list[int]] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Save `model` (a transformers causal LM) at `path` as GGUF architecture `arch`. Matrices
    are float32, or `quantize_matrices` ("Q8_0", "Q4_1", ...) blocks; norms stay float32.
    `raw_matrices` gives some matrices as (blocks in the file's row order, block type)
    instead: the model's weights must be what they dequantize to. `metadata`: further keys
    (strings, numbers as float32, or arrays) the model's own config does not write; `extra_tensors`:
    further tensors, by GGUF name (float ones as float32, integer ones as they are)."""
    import gguf

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # Gemma 3 has one set of RoPE parameters per kind of layer: the file's are the global ones.
    global_rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    rope_theta = getattr(config, "rope_theta", None) or global_rope["rope_theta"]
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    writer.add_rope_dimension_count(int(head_dim * partial))  # Phi-4-mini rotates 3/4 of each head
    if rope.get("rope_type") == "longrope":  # Phi-3: the factors as tensors, as llama.cpp writes them
        original = config.original_max_position_embeddings
        factor = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        )
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if rope.get("rope_type") == "yarn":  # the keys llama.cpp's converter writes
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if key in rope:
                add(rope[key])
    if rope.get("rope_type") == "llama3":  # Llama 3.x: one divisor per rotary frequency, as a tensor
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        plain = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    if arch in GEMMA_ARCHES:
        _add_gemma_fields(writer, config, arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_float32(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    block_type = None if quantize_matrices is None else gguf.GGMLQuantizationType[quantize_matrices]
    for hf_name, parameter in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = parameter.detach().float().numpy()
        if arch in GEMMA_ARCHES and hf_name.endswith("norm.weight"):
            array = array + 1
        if arch in PERMUTED_QK and hf_name.endswith("self_attn.q_proj.weight"):
            array = _interleave_rotary_halves(array, heads)
        elif arch in PERMUTED_QK and hf_name.endswith("self_attn.k_proj.weight"):
            array = _interleave_rotary_halves(array, kv_heads)
        if raw_matrices is not None and hf_name in raw_matrices:
            raw, type_name = raw_matrices[hf_name]
            kind = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(gguf_name(hf_name, arch), raw, raw_shape=raw.shape, raw_dtype=kind)
        elif block_type is not None and array.ndim == 2:
            writer.add_tensor(gguf_name(hf_name, arch), gguf.quants.quantize(array, block_type), raw_dtype=block_type)
        else:
            writer.add_tensor(gguf_name(hf_name, arch), np.ascontiguousarray(array, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32 if array.dtype.kind == "f" else None))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_gemma_fields(writer, config, arch: str) -> None:
    """What llama.cpp's converter writes for Gemma 2 / 3: the window, the soft-caps, Gemma 3's
    global RoPE and its sliding layers' base and, where the layers do not follow the default
    interleaving, which layers slide."""
    import gguf

    writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":  # (files written before llama.cpp stored the caps have none)
        if config.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if config.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        return
    global_rope = config.rope_parameters["full_attention"]
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    if global_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(global_rope["factor"])
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])


def quantize_q5_k(weight: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] (columns a multiple of 256) -> uint8 [rows, 176 per 256 weights]:
    Q5_K super-blocks as GGUF lays them out (d, dmin, 12 bytes of 6-bit scales and minimums,
    32 of fifth bits, 128 of nibbles). A plain rounding (llama.cpp searches each block's
    scale, gguf-py cannot make K-quants at all); enough to serve a real model's weights."""
    rows = len(weight)
    blocks = weight.astype(np.float32).reshape(-1, 8, 32)  # [super-block, block, weight]
    low = np.minimum(blocks.min(axis=-1), 0.0)
    scale, minimum = (blocks.max(axis=-1) - low) / 31, -low  # per block, both >= 0
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (minimum.max(axis=-1) / 63).astype(np.float16)
    safe_d, safe_dmin = (np.where(x == 0, 1, x.astype(np.float32))[:, None] for x in (d, dmin))
    sc = np.clip(np.round(scale / safe_d), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(minimum / safe_dmin), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.round((blocks + offset) / np.where(step == 0, 1, step)), 0, 31).astype(np.uint8)
    packed_scales = np.concatenate(  # the inverse of gguf-py's Q4_K.get_scale_min
        (
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4),
        ),
        axis=-1,
    )
    fifth_bits = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)  # byte l, bit b
    nibbles = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)  # run j: block 2j low, 2j + 1 high
    parts = (d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed_scales, fifth_bits)
    return np.concatenate((*parts, nibbles.reshape(-1, 128)), axis=-1).reshape(rows, -1)


@functools.cache
def _gguf_reader(source: Path) -> gguf.GGUFReader:
    """gguf-py's reader of `source`, kept for the test session: it parses every metadata
    entry, the 49 k-token vocabulary included (about 6 s on a Zen 1 core), which copy_gguf
    needs for each value's type."""
    import gguf

    return gguf.GGUFReader(source)


def copy_gguf(
    source: Path,
    path: Path,
    replace: dict[str, tuple[np.ndarray, str]] | None = None,
    metadata: dict[str, tuple[object, gguf.GGUFValueType]] | None = None,
) -> Path:
    """`source` written again at `path`, its metadata and tensors as they are except those
    named in `replace` (GGUF name -> (blocks in the file's row order, block type)) and the
    keys in `metadata` (key -> (value, its GGUF type)), which are set or added."""
    import gguf

    replace, metadata = replace or {}, metadata or {}

    reader = _gguf_reader(Path(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in metadata:
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for key, (value, value_type) in metadata.items():
        writer.add_key_value(key, value, value_type)
    for tensor in reader.tensors:
        data, kind = replace.get(tensor.name, (tensor.data, tensor.tensor_type.name))
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
