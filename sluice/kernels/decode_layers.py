"""All decoder layers of a forward step in one C call (decode_layers.c).

At batch 1 a Llama layer is about ten kernels of 5-30 us each; driven one by one from
Python, the interpreter and ctypes cost about as much again. The C loop runs the same
kernels with the same arithmetic, so its output equals the per-op path's.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Protocol

import torch

from sluice.kernels.loader import load_kernels

_float_p = ctypes.POINTER(ctypes.c_float)
_byte_p = ctypes.POINTER(ctypes.c_uint8)


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        ("input_norm", _float_p), ("post_attention_norm", _float_p),
        ("qkv", _byte_p), ("o", _byte_p), ("gate_up", _byte_p), ("down", _byte_p),
        ("qkv_format", ctypes.c_int), ("o_format", ctypes.c_int),
        ("gate_up_format", ctypes.c_int), ("down_format", ctypes.c_int),
        ("qkv_bias", _float_p),
    ]


class _ModelDims(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int), ("hidden", ctypes.c_int), ("heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int),
        ("eps", ctypes.c_float), ("attention_scale", ctypes.c_float),
    ]


class QuantizedProjection(Protocol):
    """What the C loop reads of a block-quantized projection (a QuantizedLinearWeight)."""

    format: int  # BlockFormat
    packed: torch.Tensor  # uint8, qgemm.c's row-group layout


@dataclass(slots=True)
class LayerTensors:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: QuantizedProjection
    o: QuantizedProjection
    gate_up: QuantizedProjection
    down: QuantizedProjection
    qkv_bias: torch.Tensor | None


def _pointer(tensor: torch.Tensor | None, pointer_type: type) -> ctypes._Pointer | None:
    return None if tensor is None else ctypes.cast(tensor.data_ptr(), pointer_type)


class DecodeLayers:
    """Holds pointers into the layers' tensors: the caller keeps those tensors alive (they
    are the model's own parameters)."""

    def __init__(self, layers: list[LayerTensors], hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float) -> None:
        self._kernels = load_kernels()
        self._pools: tuple[list[torch.Tensor], list[torch.Tensor], ctypes.Array, ctypes.Array] | None = None
        self._dims = _ModelDims(len(layers), hidden, heads, kv_heads, head_dim, intermediate, eps, head_dim ** -0.5)
        self._layers = (_LayerWeights * len(layers))(*[
            _LayerWeights(
                _pointer(layer.input_norm, _float_p), _pointer(layer.post_attention_norm, _float_p),
                _pointer(layer.qkv.packed, _byte_p), _pointer(layer.o.packed, _byte_p),
                _pointer(layer.gate_up.packed, _byte_p), _pointer(layer.down.packed, _byte_p),
                layer.qkv.format, layer.o.format, layer.gate_up.format, layer.down.format,
                _pointer(layer.qkv_bias, _float_p),
            )
            for layer in layers
        ])

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out_slots: torch.Tensor,
            attn_slots: torch.Tensor, slot_rows: torch.Tensor | None, seq_lens: torch.Tensor, max_len: int,
            k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> torch.Tensor:
        """hidden [tokens, hidden_size] float32 embeddings (overwritten) -> the residual stream
        after the last layer; attention arguments as for ops.decode_attention."""
        tokens = hidden.shape[0]
        scratch = torch.empty(self._kernels.sluice_decode_layers_scratch_bytes(ctypes.byref(self._dims), tokens),
                              dtype=torch.uint8)
        k_array, v_array = self._pool_arrays(k_pools, v_pools)
        status = self._kernels.sluice_decode_layers(
            ctypes.byref(self._dims), self._layers, k_array, v_array, tokens, hidden.data_ptr(), cos.data_ptr(),
            signed_sin.data_ptr(), out_slots.data_ptr(), attn_slots.data_ptr(),
            None if slot_rows is None else slot_rows.data_ptr(), seq_lens.data_ptr(), max_len, scratch.data_ptr(),
        )
        if status != 0:
            raise MemoryError("the decode layers could not allocate their attention scratch")
        return hidden

    def _pool_arrays(self, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array]:
        # The scheduler passes the same pool lists every step: build their pointer arrays once.
        # Holding the lists keeps them alive, so a new list can never reuse their identity.
        if self._pools is None or self._pools[0] is not k_pools or self._pools[1] is not v_pools:
            array_type = ctypes.c_void_p * len(k_pools)
            self._pools = (k_pools, v_pools, array_type(*[t.data_ptr() for t in k_pools]),
                           array_type(*[t.data_ptr() for t in v_pools]))
        return self._pools[2], self._pools[3]
