"""Load model weights into a mapping keyed by Hugging Face parameter names.

GGUF tensors are renamed, so the model only ever sees one naming. A quantized matrix the
plan keeps quantized comes as BlockRows read from the file's blocks (gguf_blocks.py), the
rest as float tensors. A GGUF's tensors are read from the file as the model takes them
(lazy_weights.py), so loading never holds every tensor's copy at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sluice.model.block_rows import BlockFormat, BlockRows
from sluice.model.gguf_blocks import block_rows
from sluice.model.gguf_file import GGUFTensor, read_gguf
from sluice.model.lazy_weights import LazyWeights
from sluice.model.model_config import ModelConfig, is_gguf
from sluice.model.safetensors_files import safetensors_shards, safetensors_weight_map
from sluice.procutil import drop_mapped_pages, release_freed_memory

Weight = torch.Tensor | BlockRows
Weights = LazyWeights[Weight]
FormatPlan = Callable[[str], BlockFormat | None]  # HF weight name -> its block format, or None: dense
FLOAT_TYPES = ("F32", "F16", "BF16")

# GGUF tensor name (after "blk.{i}.") -> HF parameter name (after "model.layers.{i}.").
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v in one tensor
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms a layer: llama.cpp's "ffn_norm" is the norm before the MLP there.
_GGUF_SANDWICH_NORM_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TRIM_EVERY_BYTES = 512 * 2**20  # of float copies made and freed while reading a GGUF
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def load_weights(
    path: str | Path, config: ModelConfig, dtype: torch.dtype, format_of: FormatPlan | None = None
) -> Weights:
    """All parameters of the model at `path`, in HF naming, as `dtype` tensors, except a
    GGUF's quantized matrices that `format_of` gives a block format: those come as BlockRows.
    A GGUF's are read from the file when first taken.

    A tied model may lack `lm_head.weight`; the model then reuses the embedding.
    """
    if is_gguf(path):
        weights = _gguf_weights(Path(path), config, dtype, format_of)
    else:
        tensors = _load_safetensors_folder(Path(path), dtype)
        if config.norm_weight_offset:
            # Gemma's norms scale by (1 + w), and its checkpoints store w (llama.cpp's
            # converter stores 1 + w in the GGUF already).
            for name in [name for name in tensors if name.endswith("norm.weight")]:
                tensors[name] = tensors[name].float().add_(config.norm_weight_offset).to(dtype)
        if config.vision is not None:
            tensors = {_llava_name(name): tensor for name, tensor in tensors.items()}
        elif config.text_of is not None:  # the language model of a vision-language checkpoint
            renamed = {_llava_name(name): tensor for name, tensor in tensors.items()}
            tensors = {name: tensor for name, tensor in renamed.items() if name.startswith(("model.", "lm_head."))}
        weights = LazyWeights[Weight].of(dict[str, Weight](tensors))
    _split_fused_projections(weights, config)
    _order_for_partial_rotary(weights, config)
    return weights


def _order_for_partial_rotary(weights: Weights, config: ModelConfig) -> None:
    """A model that rotates only the first rotary_dim dimensions of each q/k head pairs i with
    i + rotary_dim / 2; sluice rotates whole heads, pairing i with i + head_dim / 2, and gives
    the dimensions past rotary_dim frequency 0. Ordering each q and k head as [rotating first
    half, passing first half, rotating second half, passing second half] makes the two the
    same; q.k is unchanged, since q and k are ordered alike (v and o_proj are untouched)."""
    rotary_dim, head_dim = config.rotary_dim, config.head_dim
    if rotary_dim is None:
        return
    half, passing = rotary_dim // 2, (head_dim - rotary_dim) // 2
    within = torch.cat(
        [
            torch.arange(0, half),
            torch.arange(rotary_dim, rotary_dim + passing),
            torch.arange(half, rotary_dim),
            torch.arange(rotary_dim + passing, head_dim),
        ]
    )
    heads_of = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads, "q_norm": 1, "k_norm": 1}
    for name in list(weights):
        heads = heads_of.get(name.rsplit(".", 2)[-2]) if name.count(".") >= 2 else None
        if heads is None:
            continue
        order = (torch.arange(heads).unsqueeze(1) * head_dim + within).reshape(-1)
        weights.transform(name, functools.partial(_take_rows, order=order))


def _take_rows(weight: Weight, order: torch.Tensor) -> Weight:
    return weight.take_rows(order) if isinstance(weight, BlockRows) else weight[order]


def _split_fused_projections(weights: Weights, config: ModelConfig) -> None:
    """Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`: split them into
    the names every other model uses (the model fuses them again its own way)."""
    q_rows, kv_rows, ffn_rows = (
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
        config.intermediate_size,
    )
    # fused name's end -> its parts' names' ends, their rows, and what the rows are called
    layouts = {
        "self_attn.qkv_proj.weight": (
            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
            [q_rows, kv_rows, kv_rows],
            "q + k + v",
        ),
        "mlp.gate_up_proj.weight": (
            ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
            [ffn_rows, ffn_rows],
            "2 x intermediate_size",
        ),
    }
    for name in list(weights):
        for fused_end, (part_ends, sizes, expected) in layouts.items():
            if not name.endswith(fused_end):
                continue
            prefix = name.removesuffix(fused_end)

            def divide(
                fused: Weight, name: str = name, sizes: list[int] = sizes, expected: str = expected
            ) -> list[Weight]:
                if fused.shape[0] != sum(sizes):
                    raise ValueError(f"{name} has {fused.shape[0]} rows, not {expected} = {sum(sizes)}")
                return list(fused.split(sizes))

            weights.split(name, [prefix + end for end in part_ends], divide)


# LLaVA checkpoints name parameters in two layouts: the one `save_pretrained` and llava-hf
# write ("language_model.model.", ...) and transformers 5's module tree ("model.language_model.",
# ...). Both map to the text model's own names plus "vision_tower." and "multi_modal_projector.".
_LLAVA_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _llava_name(name: str) -> str:
    for old_prefix, new_prefix in _LLAVA_PREFIXES:
        if name.startswith(old_prefix):
            name = new_prefix + name.removeprefix(old_prefix)
            break
    # Older CLIP/SigLIP checkpoints nest the tower one level deeper.
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


@functools.cache
def _readable(tensor_type: GGMLQuantizationType) -> bool:
    """Whether gguf can dequantize the type (it knows some it cannot: Q8_K, F64, I32, ...)."""
    import gguf

    try:
        gguf.quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[tensor_type][1]), dtype=np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def _gguf_weights(path: Path, config: ModelConfig, dtype: torch.dtype, format_of: FormatPlan | None) -> Weights:
    import gguf

    gguf_file = read_gguf(path)
    tensors, mapped = gguf_file.tensors, gguf_file.data
    for tensor in tensors:
        if not _readable(tensor.tensor_type):
            kind = tensor.tensor_type.name
            raise ValueError(f"tensor {tensor.name} of {path.name} is {kind}, a type sluice cannot read")
    # llama.cpp's converter permutes Q/K rows of llama models for its rotary layout; Qwen2,
    # Qwen3, Phi-3 and Gemma use the NeoX layout there and are stored unpermuted.
    unpermute_qk = config.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
    float_bytes_freed = 0

    def read(tensor: GGUFTensor, name: str) -> Weight:
        nonlocal float_bytes_freed
        type_name = tensor.tensor_type.name
        format = format_of(name) if format_of is not None and type_name not in FLOAT_TYPES else None
        weight: Weight
        what = f"tensor {tensor.name} of {path.name}"
        if format is not None and len(tensor.shape) == 2:
            # GGUF lists dimensions innermost first: [in, out] for a linear.
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))
            weight = _checked_scales(block_rows(tensor.data, type_name, shape, format), what)
        else:
            # dequantize returns the array in row-major HF order ([out, in] for a linear);
            # unquantized tensors come back as read-only views of the file: copy those.
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            weight = torch.from_numpy(np.require(array, requirements=["C", "W"]))
            weight = _checked_values(weight, what, dtype)
        if unpermute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _undo_rotary_permutation(name, weight, config.num_heads, config.head_dim)
        elif unpermute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _undo_rotary_permutation(name, weight, config.num_kv_heads, config.head_dim)
        # Converting a tensor frees float copies tens of MB large, which glibc keeps (its mmap
        # threshold rises past them): hand them back now and then, or they add up to
        # gigabytes at 1 B parameters. Trimming after every tensor costs seconds.
        # The file's pages read so far leave the process's memory too: else the whole file
        # stays resident beside the blocks copied out of it until loading ends.
        float_bytes_freed += 4 * int(np.prod(tensor.shape))
        if float_bytes_freed > _TRIM_EVERY_BYTES:
            release_freed_memory()
            drop_mapped_pages(mapped)
            float_bytes_freed = 0
        return weight

    readers: dict[str, Callable[[], Weight]] = {}
    for tensor in tensors:
        name = _hf_name(tensor.name, config)
        if name is not None:
            readers[name] = lambda tensor=tensor, name=name: read(tensor, name)  # type: ignore[misc]
        elif tensor.name not in _GGUF_TENSORS_READ_AS_CONFIG:
            # An MoE router or expert, a norm sluice does not apply: serving without it would be wrong.
            raise ValueError(f"tensor {tensor.name} of {path.name} is not one sluice reads for {config.architecture}")
    return LazyWeights(readers)


# Tensors that are settings, not weights: gguf_config.py reads them as the model's RoPE scaling.
_GGUF_TENSORS_READ_AS_CONFIG = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def gguf_tensor_types(path: str | Path, config: ModelConfig) -> dict[str, str]:
    """HF weight name -> the GGUF storage type of that tensor ("Q4_1", "Q8_0", "F32", ...)."""
    types = {}
    for tensor in read_gguf(path).tensors:
        name = _hf_name(tensor.name, config)
        if name is None:
            continue
        # A fused tensor's parts (as _split_fused_projections names them) share its type.
        for fused, parts in _FUSED_PARTS.items():
            if name.endswith(fused):
                types.update({name.removesuffix(fused) + part: tensor.tensor_type.name for part in parts})
        types[name] = tensor.tensor_type.name
    return types


_FUSED_PARTS = {
    "qkv_proj.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight"),
}


def _hf_name(gguf_name: str, config: ModelConfig) -> str | None:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: "weight" or "bias"
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        hf_part = _GGUF_LAYER_NAMES.get(part)
        if config.sandwich_norms:
            hf_part = _GGUF_SANDWICH_NORM_NAMES.get(part, hf_part)
        if part == "ffn_up" and config.architecture == "Phi3ForCausalLM":
            hf_part = "mlp.gate_up_proj"  # Phi-3's ffn_up holds gate and up, one above the other
        return None if hf_part is None else f"model.layers.{layer}.{hf_part}.{suffix}"
    hf_stem = _GGUF_TOP_NAMES.get(stem)
    return None if hf_stem is None else f"{hf_stem}.{suffix}"


def _undo_rotary_permutation(name: str, weight: Weight, num_heads: int, head_dim: int) -> Weight:
    """Inverse of llama.cpp's per-head row interleaving of a Q or K projection (the weight
    `name`); a ValueError where its rows are not the config's heads."""
    if len(weight) != num_heads * head_dim:
        rows, implied = len(weight), num_heads * head_dim
        raise ValueError(f"{name} has {rows} rows: the config implies {num_heads} heads of {head_dim} = {implied}")
    order = torch.arange(len(weight)).reshape(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)
    return _take_rows(weight, order)


def _checked_values(tensor: torch.Tensor, what: str, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`, or a ValueError naming `what` where it holds values no model serves
    from: NaN or infinities (every answer would be token 0), or integers (a quantized
    checkpoint's packed weights, which cast to floats would be noise)."""
    if not tensor.is_floating_point():
        raise ValueError(f"{what} is {tensor.dtype}: sluice reads floating-point weights (or GGUF blocks)")
    converted = tensor.to(dtype)
    if not torch.isfinite(converted).all():
        raise ValueError(f"{what} holds NaN or infinite values")
    return converted


def _checked_scales(rows: BlockRows, what: str) -> BlockRows:
    """`rows`, or a ValueError naming `what` where a block's scale or minimum is NaN or
    infinite (in the file, or past float16 once a Q4_K block's d sc is rounded to it): the
    kernels would answer token 0 to everything, as with a NaN weight."""
    if not all(torch.isfinite(part).all() for part in rows.scales if part.is_floating_point()):
        raise ValueError(f"{what} holds NaN or infinite block scales")
    return rows


def _load_safetensors_folder(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    shard_of: dict[str, str] = {}
    weight_map = safetensors_weight_map(folder) or {}
    for shard_name in safetensors_shards(folder, weight_map):
        for name, tensor in load_file(str(folder / shard_name)).items():
            # A weight in two shards is not read from whichever came last.
            if weight_map.get(name, shard_name) != shard_name:
                raise ValueError(
                    f"{name} is in {shard_name}, but model.safetensors.index.json puts it in {weight_map[name]}"
                )
            if name in shard_of:
                raise ValueError(f"{name} is in both {shard_of[name]} and {shard_name}")
            shard_of[name] = shard_name
            # Precomputed buffers of old checkpoints (rotary inv_freq, a vision tower's
            # position_ids) are no weights.
            if "rotary_emb" in name or (not tensor.is_floating_point() and not name.endswith((".weight", ".bias"))):
                continue
            weights[name] = _checked_values(tensor, f"{name} in {shard_name}", dtype)
    return weights
