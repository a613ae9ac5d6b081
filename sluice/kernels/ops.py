"""Tensor-level calls into one loaded build of the C kernels.

Every call checks what it hands to C (device, dtype, layout, shape) and every status C
returns: a wrong tensor is a Python exception here, never memory read out of bounds.
Activations are float32; KV pools are float32, float16, bfloat16 or float8_e5m2.
"""

from __future__ import annotations

import torch

from sluice.kernels.contract import BLOCK, Activation, BlockFormat, KvDtype
from sluice.kernels.loader import Kernels

KV_DTYPES = {
    torch.float32: KvDtype.FLOAT32,
    torch.float16: KvDtype.FLOAT16,
    torch.bfloat16: KvDtype.BFLOAT16,
    torch.float8_e5m2: KvDtype.FP8_E5M2,
}


def _pointer(tensor: torch.Tensor, name: str, dtype: torch.dtype, contiguous: bool = True) -> int:
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, not {tensor.device}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, not {tensor.dtype}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return tensor.data_ptr()


def kv_dtype_code(pool: torch.Tensor) -> KvDtype:
    try:
        return KV_DTYPES[pool.dtype]
    except KeyError:
        raise TypeError(f"a KV pool must be float32, float16, bfloat16 or float8_e5m2, not {pool.dtype}") from None


def _pool_pointers(k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[int, int, KvDtype]:
    kv_dtype = kv_dtype_code(k_pool)
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"K and V pools differ in shape: {tuple(k_pool.shape)} vs {tuple(v_pool.shape)}")
    return (_pointer(k_pool, "k_pool", k_pool.dtype), _pointer(v_pool, "v_pool", k_pool.dtype), kv_dtype)


def _prompt_flags(prompt_rows: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The contiguous bool flags of qgemm's prompt rows, checked against the call's rows."""
    if prompt_rows is None:
        return None
    if prompt_rows.shape != (rows,):
        raise ValueError(f"prompt_rows must be [{rows}], not {tuple(prompt_rows.shape)}")
    flags = prompt_rows.contiguous()
    _pointer(flags, "prompt_rows", torch.bool)
    return flags


def _check_qgemm_status(status: int, name: str, in_features: int, format: BlockFormat) -> None:
    if status == -2:
        raise RuntimeError(f"{name}: the OS refused this process the AMX tile registers")
    if status != 0:
        raise ValueError(f"{name} refused in_features={in_features} or format {format!r}")


class KernelOps:
    """The kernels of one build (one instruction set), as torch-tensor functions."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels
        self.lib = kernels.lib

    @property
    def isa(self) -> str:
        return self.kernels.isa

    @property
    def row_group(self) -> int:
        return self.kernels.row_group

    def qgemm(
        self,
        x: torch.Tensor,
        format: BlockFormat,
        packed: torch.Tensor,
        out_features: int,
        out: torch.Tensor | None = None,
        prompt_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [rows, in] float32 @ W.T -> float32 [rows, out_features], W packed in this build's
        row groups; written into `out` when given (rows of contiguous floats, e.g. some
        columns of a wider matrix). prompt_rows: bool [rows], True for the rows of prompt
        tokens, which an AMX-BF16 build multiplies on bf16 tiles (see qgemm.c)."""
        if x.dim() != 2 or x.shape[1] % BLOCK:
            raise ValueError(f"qgemm takes [rows, k] with k a multiple of {BLOCK}, not {tuple(x.shape)}")
        x = x.contiguous()
        rows, in_features = x.shape
        if out is None:
            out = torch.empty(rows, out_features)
        elif out.shape != (rows, out_features) or out.stride(1) != 1:
            raise ValueError(f"out must be [{rows}, {out_features}] with contiguous rows, not {tuple(out.shape)}")
        flags = _prompt_flags(prompt_rows, rows)
        scratch = torch.empty(self.lib.sluice_qgemm_scratch_bytes(rows, in_features), dtype=torch.uint8)
        status = self.lib.sluice_qgemm(
            rows,
            out_features,
            in_features,
            _pointer(x, "x", torch.float32),
            int(format),
            _pointer(packed, "packed weights", torch.uint8),
            _pointer(out, "out", torch.float32, contiguous=False),
            out.stride(0),
            scratch.data_ptr(),
            None if flags is None else flags.data_ptr(),
        )
        _check_qgemm_status(status, "qgemm", in_features, format)
        return out

    def qgemm_gated(
        self,
        x: torch.Tensor,
        format: BlockFormat,
        packed: torch.Tensor,
        intermediate: int,
        activation: Activation,
        prompt_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """act(x @ gate.T) * (x @ up.T) -> float32 [rows, intermediate], W = [gate; up] packed
        as qgemm takes it (2 * intermediate rows, intermediate a multiple of row_group): the
        bits of qgemm then silu_mul / gelu_tanh_mul. An AMX-BF16 build never stores the prompt
        rows' [gate | up] matrix, twice the output's size."""
        if x.dim() != 2 or x.shape[1] % BLOCK:
            raise ValueError(f"qgemm_gated takes [rows, k] with k a multiple of {BLOCK}, not {tuple(x.shape)}")
        if intermediate <= 0 or intermediate % self.row_group:
            raise ValueError(f"qgemm_gated needs an intermediate size that is a multiple of {self.row_group}")
        x = x.contiguous()
        rows, in_features = x.shape
        out = torch.empty(rows, intermediate)
        flags = _prompt_flags(prompt_rows, rows)
        scratch_bytes = self.lib.sluice_qgemm_gated_scratch_bytes(rows, intermediate, in_features)
        scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
        status = self.lib.sluice_qgemm_gated(
            rows,
            intermediate,
            in_features,
            _pointer(x, "x", torch.float32),
            int(format),
            _pointer(packed, "packed weights", torch.uint8),
            out.data_ptr(),
            intermediate,
            scratch.data_ptr(),
            None if flags is None else flags.data_ptr(),
            int(activation),
        )
        _check_qgemm_status(status, "qgemm_gated", in_features, format)
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x.argmax(-1) for a float32 [rows, cols] matrix, the same indices (ties and NaN included)."""
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        if rows and cols:
            self.lib.sluice_argmax_rows(rows, cols, _pointer(x, "x", torch.float32), out.data_ptr())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        rows, dim = x.shape
        out = torch.empty_like(x)
        self.lib.sluice_rmsnorm(
            rows, dim, _pointer(x, "x", torch.float32), _norm_weight(weight, dim), eps, out.data_ptr()
        )
        return out

    def rms_norm_heads(self, heads: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """RMS-normalize each head_dim row of heads [tokens, n, head_dim] in place: a view of
        some heads of qkv rows (rows of heads contiguous, tokens any stride apart)."""
        tokens, count, dim = heads.shape
        if heads.stride(2) != 1 or heads.stride(1) != dim:
            raise ValueError(f"heads must be [tokens, n, {dim}] with contiguous heads, not strides {heads.stride()}")
        if tokens and count:
            self.lib.sluice_rmsnorm_heads(
                tokens,
                count,
                dim,
                _pointer(heads, "heads", torch.float32, contiguous=False),
                heads.stride(0),
                _norm_weight(weight, dim),
                eps,
            )

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """hidden += delta in place; returns rms_norm(hidden). hidden must be contiguous."""
        rows, dim = hidden.shape
        if delta.shape != hidden.shape:
            raise ValueError(f"delta {tuple(delta.shape)} does not match hidden {tuple(hidden.shape)}")
        delta = delta.contiguous()
        out = torch.empty_like(hidden)
        self.lib.sluice_add_rmsnorm(
            rows,
            dim,
            _pointer(hidden, "hidden", torch.float32),
            _pointer(delta, "delta", torch.float32),
            _norm_weight(weight, dim),
            eps,
            out.data_ptr(),
        )
        return out

    def decode_attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
        slot_rows: torch.Tensor | None = None,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        prompt_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [queries, heads, head_dim] over pooled K/V through padded slots [requests * max_len]:
        query i sees the first seq_lens[i] slots of row slot_rows[i] (None: row i), or only the
        last `sliding_window` of them. Scores are q.k * scale (None: head_dim ** -0.5), then
        softcap * tanh(score / softcap) when a softcap is given. prompt_rows: bool [queries],
        True for prompt tokens, which an AMX-BF16 build attends on bf16 tiles (see
        prompt_attention_amx.h).
        q's rows may be strided (a view into the qkv projection); each row's heads must be contiguous."""
        queries, heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        k_pointer, v_pointer, kv_dtype = _pool_pointers(k_pool, v_pool)
        kv_heads = k_pool.shape[1]
        if k_pool.shape[2] != head_dim or heads % kv_heads:
            raise ValueError(f"q heads {heads} x {head_dim} do not fit pools of {kv_heads} x {k_pool.shape[2]}")
        if seq_lens.shape != (queries,) or (slot_rows is not None and slot_rows.shape != (queries,)):
            raise ValueError("seq_lens (and slot_rows) must hold one entry per query")
        if prompt_rows is not None and prompt_rows.shape != (queries,):
            raise ValueError(f"prompt_rows must be [{queries}], not {tuple(prompt_rows.shape)}")
        out = q.new_empty(queries, heads, head_dim)
        status = self.lib.sluice_decode_attention(
            queries,
            heads,
            kv_heads,
            head_dim,
            max_len,
            head_dim**-0.5 if scale is None else scale,
            sliding_window or 0,
            softcap or 0.0,
            _pointer(q, "q", torch.float32, False),
            q.stride(0),
            k_pointer,
            v_pointer,
            int(kv_dtype),
            _pointer(slots, "slots", torch.int64),
            None if slot_rows is None else _pointer(slot_rows, "slot_rows", torch.int64),
            _pointer(seq_lens, "seq_lens", torch.int64),
            None if prompt_rows is None else _pointer(prompt_rows, "prompt_rows", torch.bool),
            out.data_ptr(),
        )
        if status != 0:
            raise MemoryError("decode attention could not allocate its score buffer")
        return out

    def rope_and_store(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Rotate the q and k heads of contiguous qkv [tokens, heads + 2 * kv_heads, head_dim] in
        place, then store its k and v rows in the pools at `slots`. cos/signed_sin: [tokens, head_dim]."""
        tokens, _, head_dim = qkv.shape
        k_pointer, v_pointer, kv_dtype = _pool_pointers(k_pool, v_pool)
        if cos.shape != (tokens, head_dim) or signed_sin.shape != cos.shape or slots.shape != (tokens,):
            raise ValueError("cos, signed_sin and slots must hold one row per token")
        self.lib.sluice_rope_store(
            tokens,
            num_heads,
            k_pool.shape[1],
            head_dim,
            _pointer(qkv, "qkv", torch.float32),
            _pointer(cos, "cos", torch.float32),
            _pointer(signed_sin, "signed_sin", torch.float32),
            k_pointer,
            v_pointer,
            int(kv_dtype),
            _pointer(slots, "slots", torch.int64),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for contiguous gate_up = [gate | up] of shape [rows, 2 * width]."""
        rows, double_width = gate_up.shape
        out = gate_up.new_empty(rows, double_width // 2)
        self.lib.sluice_silu_mul(rows, double_width // 2, _pointer(gate_up, "gate_up", torch.float32), out.data_ptr())
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate) * up, GELU's tanh form (Gemma's GeGLU), as silu_mul takes its input."""
        rows, double_width = gate_up.shape
        out = gate_up.new_empty(rows, double_width // 2)
        self.lib.sluice_gelu_tanh_mul(
            rows, double_width // 2, _pointer(gate_up, "gate_up", torch.float32), out.data_ptr()
        )
        return out


def _norm_weight(weight: torch.Tensor, dim: int) -> int:
    if weight.shape != (dim,):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match width {dim}")
    return _pointer(weight, "norm weight", torch.float32)
