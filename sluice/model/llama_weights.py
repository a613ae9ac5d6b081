"""Moving a checkpoint's weights into a LlamaForCausalLM, and block-quantizing those that
came dense.

Weights come HF-named (model/weights.py renames a GGUF's); q/k/v and gate/up are fused into
the layer's one projection each. A matrix whose sources all came as block rows stays in
blocks; anything the model has no place for is refused, never dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from sluice.model.backend import Backend, KernelBackend
from sluice.model.block_rows import BlockFormat, BlockRows, fused_format
from sluice.model.quantized_linear import (
    QuantizedLinearWeight,
    QuantizedProjection,
    StackedQuantizedWeight,
    quantized_projection,
)
from sluice.model.weights import Weight, Weights
from sluice.procutil import release_freed_memory

if TYPE_CHECKING:
    from sluice.model.llama import DecoderLayer, LlamaForCausalLM

# Source weight names (after "model.layers.{i}.") of each fused projection.
_QKV_SOURCES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP_SOURCES = ("mlp.gate_proj", "mlp.up_proj")


@torch.no_grad()
def load_llama_weights(model: LlamaForCausalLM, weights: Weights) -> None:
    """Move HF-named weights in (each leaves `weights`), fusing q/k/v and gate/up. A matrix
    whose sources all came as BlockRows stays in blocks, never taking a float copy.
    ValueError naming a weight that is missing or whose shape disagrees with the config."""
    blocks = _BlockLoader(model.backend, weights)
    embedding = blocks.take_one(model, "embed_tokens", "model.embed_tokens.weight")
    if embedding is not None:
        # A quantized table: tokens are looked up in its blocks.
        model.embedding_blocks = embedding
    _copy_in(model.norm.weight, weights, "model.norm.weight")
    if not model.config.tie_word_embeddings and "lm_head.weight" not in weights:
        raise ValueError("weight lm_head.weight is missing, and the config's tie_word_embeddings is false")
    if model.config.tie_word_embeddings:
        model.lm_head = model.embed_tokens
        model.lm_head_quantized = embedding
    else:
        model.lm_head = nn.Parameter(
            torch.empty(model.config.vocab_size, model.config.hidden_size, dtype=model.dtype), requires_grad=False
        )
        model.lm_head_quantized = blocks.take_one(model, "lm_head", "lm_head.weight")
    for index, layer in enumerate(model.decoder_layers):
        _load_layer(layer, blocks, f"model.layers.{index}.")
        # The layer's file blocks (or float copies) are freed now, amid the heap glibc
        # keeps: hand them back, or the whole model's worth stays resident beside its
        # packed copy until loading ends.
        release_freed_memory()
    _refuse_weights_left(model, weights)


def _refuse_weights_left(model: LlamaForCausalLM, weights: Weights) -> None:
    """A language-model weight that load_weights did not take (a Llama's o_proj or MLP
    biases, say) would be left out of every forward pass, and each answer would be wrong:
    refuse it, naming it. A tied model's saved lm_head is the one exception, as in
    transformers. A LLaVA model's vision weights are its vision tower's to take."""
    namespace = ("model.", "lm_head.") if model.config.vision is not None else ("",)
    left = [name for name in weights if name.startswith(namespace)]
    if model.lm_head is model.embed_tokens and "lm_head.weight" in left:
        left.remove("lm_head.weight")
    if left:
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        raise ValueError(
            f"weight {left[0]}{more} is in the model files but sluice's {model.config.architecture} "
            "has no place for it: serving without it would give wrong answers"
        )


@torch.no_grad()
def quantize_llama(model: LlamaForCausalLM, format_of: Callable[[str], BlockFormat | None]) -> None:
    """Replace the projection weights still dense by block-quantized ones, which every token
    then takes.

    `format_of` maps a source weight's HF name (as in load_weights) to its block format,
    or None to keep that weight dense; a fused projection is quantized only when all its
    sources are. The dense copy of a quantized weight is freed (a dense embedding table
    stays unless its blocks give it back exactly: token lookup reads it).
    """
    if not isinstance(model.backend, KernelBackend):
        raise ValueError("block-quantized weights need the C kernels (KernelBackend)")
    ops = model.backend.ops

    def quantize_in_place(module: nn.Module, dense_name: str, sources: list[str]) -> QuantizedLinearWeight | None:
        format = fused_format([format_of(name + ".weight") for name in sources])
        if format is None:
            return None
        quantized = QuantizedLinearWeight.quantize(getattr(module, dense_name), format, ops)
        setattr(module, dense_name, _freed(model.dtype))
        return quantized

    for index, layer in enumerate(model.decoder_layers):
        prefix = f"model.layers.{index}."
        if layer.qkv_proj.quantized is None:
            layer.qkv_proj.quantized = quantize_in_place(
                layer.qkv_proj, "weight", [prefix + name for name in _QKV_SOURCES]
            )
        if layer.o_proj.quantized is None:
            layer.o_proj.quantized = quantize_in_place(layer.o_proj, "weight", [prefix + "self_attn.o_proj"])
        if layer.mlp.gate_up_quantized is None:
            layer.mlp.gate_up_quantized = quantize_in_place(
                layer.mlp, "gate_up_weight", [prefix + name for name in _GATE_UP_SOURCES]
            )
        if layer.mlp.down_quantized is None:
            layer.mlp.down_quantized = quantize_in_place(layer.mlp, "down_weight", [prefix + "mlp.down_proj"])
    if model.lm_head_quantized is not None:
        pass  # loaded as blocks
    elif model.lm_head is model.embed_tokens:
        format = fused_format([format_of("model.embed_tokens.weight")])
        model.lm_head_quantized = None if format is None else QuantizedLinearWeight.quantize(model.lm_head, format, ops)
        if model.lm_head_quantized is not None and torch.equal(
            model.lm_head_quantized.dequantize(), model.embed_tokens.float()
        ):
            # The blocks are the table: look tokens up there.
            model.embedding_blocks = model.lm_head_quantized
            model.embed_tokens = _freed(model.dtype)
            model.lm_head = model.embed_tokens
    else:
        model.lm_head_quantized = quantize_in_place(model, "lm_head", ["lm_head"])
    model.decode_layers = model.fused_decode_layers(model.backend)
    model.prompt_attention = True


def _load_layer(layer: DecoderLayer, blocks: _BlockLoader, prefix: str) -> None:
    weights = blocks.weights
    attn = prefix + "self_attn."
    _copy_in(layer.input_layernorm.weight, weights, prefix + "input_layernorm.weight")
    _copy_in(layer.post_attention_layernorm.weight, weights, prefix + "post_attention_layernorm.weight")
    if layer.pre_feedforward_layernorm is not None and layer.post_feedforward_layernorm is not None:
        _copy_in(layer.pre_feedforward_layernorm.weight, weights, prefix + "pre_feedforward_layernorm.weight")
        _copy_in(layer.post_feedforward_layernorm.weight, weights, prefix + "post_feedforward_layernorm.weight")
    layer.qkv_proj.quantized = blocks.take(layer.qkv_proj, "weight", [f"{attn}{name}_proj.weight" for name in "qkv"])
    if layer.qkv_proj.bias is not None:
        _copy_in(layer.qkv_proj.bias, weights, *[f"{attn}{name}_proj.bias" for name in "qkv"])
    layer.o_proj.quantized = blocks.take_one(layer.o_proj, "weight", attn + "o_proj.weight")
    if layer.q_norm is not None and layer.k_norm is not None:
        _copy_in(layer.q_norm.weight, weights, attn + "q_norm.weight")
        _copy_in(layer.k_norm.weight, weights, attn + "k_norm.weight")
    mlp = prefix + "mlp."
    layer.mlp.gate_up_quantized = blocks.take(
        layer.mlp, "gate_up_weight", [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
    )
    layer.mlp.down_quantized = blocks.take_one(layer.mlp, "down_weight", mlp + "down_proj.weight")


class _BlockLoader:
    """Moves a matrix in from `weights`: as the kernels' blocks when every source came as
    BlockRows (the dense parameter is then freed untouched), else as float into it."""

    def __init__(self, backend: Backend, weights: Weights) -> None:
        self.backend = backend
        self.weights = weights

    def take(self, module: nn.Module, dense_name: str, names: list[str]) -> QuantizedProjection | None:
        weights = self.weights
        dense = getattr(module, dense_name)
        parts = [weights.get(name) for name in names]
        if not all(isinstance(part, BlockRows) for part in parts) or not isinstance(self.backend, KernelBackend):
            _copy_in(dense, weights, *names)
            return None
        rows = cast(list[BlockRows], parts)
        if sum(len(part) for part in rows) != len(dense) or any(part.shape[1] != dense.shape[1] for part in rows):
            shapes = ", ".join(f"{name} {list(part.shape)}" for name, part in zip(names, rows, strict=True))
            raise ValueError(f"{shapes}: the config implies {list(dense.shape)} in all")
        quantized = quantized_projection(rows, self.backend.ops)
        for name in names:
            del weights[name]
        setattr(module, dense_name, _freed(dense.dtype))
        release_freed_memory()
        return quantized

    def take_one(self, module: nn.Module, dense_name: str, name: str) -> QuantizedLinearWeight | None:
        quantized = self.take(module, dense_name, [name])
        assert not isinstance(quantized, StackedQuantizedWeight)  # one source is in one format
        return quantized


def _dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    return weight.dequantize().to(dtype) if isinstance(weight, BlockRows) else weight


def _freed(dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


def _copy_in(target: torch.Tensor, weights: Weights, *names: str) -> None:
    """target <- the named weights, stacked by rows, which leave `weights` (so the float copies
    a loaded file came as are freed one by one, not all at the end); ValueError naming a
    weight that is missing or whose shape disagrees with what the config implies (copy_
    alone would broadcast)."""
    missing = [name for name in names if name not in weights]
    if missing:
        raise ValueError(f"weight {missing[0]} is missing from the model files")
    parts = [_dense(weights[name], target.dtype) for name in names]
    if any(part.shape[1:] != target.shape[1:] for part in parts) or sum(len(p) for p in parts) != len(target):
        shapes = ", ".join(f"{name} {list(part.shape)}" for name, part in zip(names, parts, strict=True))
        raise ValueError(f"{shapes}: the config implies {list(target.shape)} in all")
    target.copy_(parts[0] if len(parts) == 1 else torch.cat(parts))
    for name in names:
        del weights[name]
