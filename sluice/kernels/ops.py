"""Tensor-level wrappers of the C kernels (float32, contiguous, on the CPU).

Callers check `kernels_available()` and keep a torch path for everything else (bfloat16,
a CPU without AVX2, no compiler).
"""

from __future__ import annotations

import functools
import logging

import torch

from sluice.kernels.loader import KernelUnavailable, load_kernels

logger = logging.getLogger(__name__)


@functools.cache
def kernels_available() -> bool:
    try:
        load_kernels()
    except KernelUnavailable as error:
        logger.warning("C kernels unavailable, using torch ops instead: %s", error)
        return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    load_kernels().sluice_rmsnorm(x.shape[0], x.shape[1], x.data_ptr(), weight.data_ptr(), eps, out.data_ptr())
    return out


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """hidden += delta in place; returns rms_norm(hidden). hidden must be contiguous."""
    delta = delta.contiguous()
    out = torch.empty_like(hidden)
    load_kernels().sluice_add_rmsnorm(hidden.shape[0], hidden.shape[1], hidden.data_ptr(), delta.data_ptr(),
                                      weight.data_ptr(), eps, out.data_ptr())
    return out


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                     seq_lens: torch.Tensor, max_len: int, slot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [queries, heads, head_dim] over pooled K/V through padded slots [requests * max_len]:
    query i sees the first seq_lens[i] slots of row slot_rows[i] (None: row i).
    q's rows may be strided (a view into the qkv projection); each row's heads must be contiguous."""
    queries, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    out = q.new_empty(queries, heads, head_dim)
    status = load_kernels().sluice_decode_attention(
        queries, heads, k_pool.shape[1], head_dim, max_len, head_dim ** -0.5, q.data_ptr(), q.stride(0),
        k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), None if slot_rows is None else slot_rows.data_ptr(),
        seq_lens.data_ptr(), out.data_ptr(),
    )
    if status != 0:
        raise MemoryError("decode attention could not allocate its score buffer")
    return out


def rope_and_store(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
                   k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotate the q and k heads of contiguous qkv [tokens, heads + 2 * kv_heads, head_dim] in
    place, then store its k and v rows in the pools at `slots`. cos/signed_sin: [tokens, head_dim]."""
    tokens, _, head_dim = qkv.shape
    load_kernels().sluice_rope_store(tokens, num_heads, k_pool.shape[1], head_dim, qkv.data_ptr(), cos.data_ptr(),
                                     signed_sin.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for contiguous gate_up = [gate | up] of shape [rows, 2 * width]."""
    rows, double_width = gate_up.shape
    out = gate_up.new_empty(rows, double_width // 2)
    load_kernels().sluice_silu_mul(rows, double_width // 2, gate_up.data_ptr(), out.data_ptr())
    return out
