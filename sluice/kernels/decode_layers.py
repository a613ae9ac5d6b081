"""All decoder layers of a forward step in one C call (decode_layers.c): Llama's layers and
Gemma's.

At batch 1 a Llama layer is about ten kernels of 5-30 us each; driven one by one from
Python, the interpreter and ctypes cost about as much again. The C loop runs the same
kernels with the same arithmetic, so its output equals the per-op path's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sluice.kernels.contract import Activation, LayerWeights, ModelDims, Projection
from sluice.kernels.ops import KV_DTYPES, KernelOps


class QuantizedMatrix(Protocol):
    """What the C loop reads of a block-quantized matrix (a QuantizedLinearWeight)."""

    @property
    def format(self) -> int: ...  # a BlockFormat

    @property
    def packed(self) -> torch.Tensor: ...  # uint8, qgemm.c's row-group layout

    @property
    def out_features(self) -> int: ...


class QuantizedProjection(Protocol):
    """A projection's matrices, stacked along its output rows: one, or a head and a tail in
    another format (a QuantizedLinearWeight or a StackedQuantizedWeight)."""

    @property
    def parts(self) -> Sequence[QuantizedMatrix]: ...


@dataclass(slots=True)
class LayerTensors:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: QuantizedProjection
    o: QuantizedProjection
    gate_up: QuantizedProjection
    down: QuantizedProjection
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # per-head RMSNorm of q and k (Qwen3)
    k_norm: torch.Tensor | None = None
    sliding_window: int | None = None  # keys a query sees, its own included; None: all
    # Gemma's norms around the MLP (post_attention_norm then norms the attention output)
    pre_feedforward_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None
    local_rope: bool = False  # rotated by the local tables (Gemma 3's sliding-window layers)


_FLOAT_P = next(kind for name, kind, *_ in LayerWeights._fields_ if name == "input_norm")
_BYTE_P = next(kind for name, kind, *_ in Projection._fields_ if name == "packed")


def _pointer(tensor: torch.Tensor | None, pointer_type: type) -> ctypes._Pointer | None:
    if tensor is None:
        return None
    expected = torch.float32 if pointer_type is _FLOAT_P else torch.uint8
    if tensor.dtype != expected or not tensor.is_contiguous():
        raise TypeError(f"a layer tensor of the one-call path must be contiguous {expected}, not {tensor.dtype}")
    return ctypes.cast(tensor.data_ptr(), pointer_type)


def _projection(weight: QuantizedProjection) -> Projection:
    head, *rest = weight.parts
    if len(rest) > 1:
        raise ValueError(f"the one-call path takes a projection in at most two parts, not {len(weight.parts)}")
    tail = rest[0] if rest else None
    return Projection(
        packed=_pointer(head.packed, _BYTE_P),
        tail=None if tail is None else _pointer(tail.packed, _BYTE_P),
        format=head.format,
        tail_format=0 if tail is None else tail.format,
        tail_rows=0 if tail is None else tail.out_features,
    )


class DecodeLayers:
    """Holds pointers into the layers' tensors: the caller keeps those tensors alive (they
    are the model's own parameters)."""

    def __init__(
        self,
        ops: KernelOps,
        layers: list[LayerTensors],
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
        kv_dtype: torch.dtype,
        attention_scale: float,
        activation: Activation = Activation.SILU,
        attn_softcap: float | None = None,
    ) -> None:
        self._lib = ops.lib
        self._pools: tuple[list[torch.Tensor], list[torch.Tensor], ctypes.Array, ctypes.Array] | None = None
        self._kv_dtype = kv_dtype
        self._dims = ModelDims(
            num_layers=len(layers),
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            eps=eps,
            attention_scale=attention_scale,
            kv_dtype=int(KV_DTYPES[kv_dtype]),
            mlp_activation=int(activation),
            attn_softcap=attn_softcap or 0.0,
        )
        self.local_rope = any(layer.local_rope for layer in layers)
        self._layers = (LayerWeights * len(layers))(
            *[
                LayerWeights(
                    input_norm=_pointer(layer.input_norm, _FLOAT_P),
                    post_attention_norm=_pointer(layer.post_attention_norm, _FLOAT_P),
                    qkv=_projection(layer.qkv),
                    o=_projection(layer.o),
                    gate_up=_projection(layer.gate_up),
                    down=_projection(layer.down),
                    qkv_bias=_pointer(layer.qkv_bias, _FLOAT_P),
                    q_norm=_pointer(layer.q_norm, _FLOAT_P),
                    k_norm=_pointer(layer.k_norm, _FLOAT_P),
                    sliding_window=layer.sliding_window or 0,
                    pre_feedforward_norm=_pointer(layer.pre_feedforward_norm, _FLOAT_P),
                    post_feedforward_norm=_pointer(layer.post_feedforward_norm, _FLOAT_P),
                    local_rope=int(layer.local_rope),
                )
                for layer in layers
            ]
        )

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        out_slots: torch.Tensor,
        attn_slots: torch.Tensor,
        slot_rows: torch.Tensor | None,
        seq_lens: torch.Tensor,
        max_len: int,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        window_slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden [tokens, hidden_size] float32 embeddings (overwritten) -> the residual stream
        after the last layer; attention arguments as for ops.decode_attention; local_rope:
        (cos, signed_sin) for the layers rotated by the local tables; window_slots: (out_slots,
        attn_slots) of the sliding-window layers where their K/V have slots of their own."""
        tokens = hidden.shape[0]
        if hidden.dtype != torch.float32 or not hidden.is_contiguous() or hidden.shape[1] != self._dims.hidden:
            raise ValueError(f"hidden must be contiguous float32 [tokens, {self._dims.hidden}]")
        if any(
            t.dtype != torch.int64 or not t.is_contiguous()
            for t in (out_slots, attn_slots, seq_lens, *(window_slots or ()))
        ):
            raise TypeError("slots and lengths must be contiguous int64")
        if self.local_rope and local_rope is None:
            raise ValueError("these layers take local rotary tables too")
        tables = [cos, signed_sin, *(local_rope or ())]
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.shape[0] != tokens for t in tables):
            raise TypeError("rotary tables must be contiguous float32 [tokens, head_dim]")
        if k_pools[0].dtype != self._kv_dtype:
            raise TypeError(f"KV pools are {k_pools[0].dtype}, these layers were built for {self._kv_dtype}")
        scratch = torch.empty(
            self._lib.sluice_decode_layers_scratch_bytes(ctypes.byref(self._dims), tokens), dtype=torch.uint8
        )
        k_array, v_array = self._pool_arrays(k_pools, v_pools)
        status = self._lib.sluice_decode_layers(
            ctypes.byref(self._dims),
            self._layers,
            k_array,
            v_array,
            tokens,
            hidden.data_ptr(),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            None if local_rope is None else local_rope[0].data_ptr(),
            None if local_rope is None else local_rope[1].data_ptr(),
            out_slots.data_ptr(),
            attn_slots.data_ptr(),
            None if window_slots is None else window_slots[0].data_ptr(),
            None if window_slots is None else window_slots[1].data_ptr(),
            None if slot_rows is None else slot_rows.data_ptr(),
            seq_lens.data_ptr(),
            max_len,
            scratch.data_ptr(),
        )
        if status != 0:
            raise MemoryError("the decode layers could not allocate their attention scratch")
        return hidden

    def _pool_arrays(
        self, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]
    ) -> tuple[ctypes.Array, ctypes.Array]:
        # The scheduler passes the same pool lists every step: build their pointer arrays once.
        # Holding the lists keeps them alive, so a new list can never reuse their identity.
        if self._pools is None or self._pools[0] is not k_pools or self._pools[1] is not v_pools:
            array_type = ctypes.c_void_p * len(k_pools)
            self._pools = (
                k_pools,
                v_pools,
                array_type(*[t.data_ptr() for t in k_pools]),
                array_type(*[t.data_ptr() for t in v_pools]),
            )
        return self._pools[2], self._pools[3]
