"""How a model's per-token operations run, decided once per model when it loads.

Two backends with one interface; the layers hold one and never ask again which path to take:

- `KernelBackend`: float32 activations through sluice's C kernels, the build for this CPU's
  best instruction set (AVX-512 VNNI or AVX2). Block-quantized projections go through the
  quantized matmul, dense ones through torch's `F.linear`; RMSNorm, rotary + KV store, the
  gated MLP's activation (in one call with its quantized matmul) and attention (sliding
  windows and soft-capping included) run in C, every token attending as a decode step at its
  position, so a request's results never depend on its batch, its chunking or its cached prefix.
- `TorchBackend`: plain torch ops in the model dtype, for bfloat16 or where the kernels
  cannot run (no AVX2, no compiler): decoding requests attend as one padded batch,
  prefilling ones through SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels.contract import Activation
from sluice.kernels.ops import KernelOps
from sluice.model.attention import AttentionMetadata, AttentionOptions, torch_attention
from sluice.model.quantized_linear import QuantizedLinearWeight, QuantizedProjection
from sluice.model.sampler import TORCH_ARGMAX_ROWS


class KernelBackend:
    name = "kernels"
    every_token_decodes = True

    def __init__(self, ops: KernelOps) -> None:
        self.ops = ops

    @property
    def isa(self) -> str:
        return self.ops.isa

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        quantized: QuantizedProjection | None,
        bias: torch.Tensor | None = None,
        prompt_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x @ weight.T (+ bias), through the block-quantized copy when the weight has one
        (prompt_rows: see KernelOps.qgemm)."""
        if quantized is None:
            return F.linear(x, weight, bias)
        out = quantized.matmul(x, prompt_rows)
        return out if bias is None else out.add_(bias)

    def argmax_rows(self, scores: torch.Tensor) -> torch.Tensor:
        """scores.argmax(-1) (greedy sampling), in C: torch's takes ~10x longer."""
        return self.ops.argmax_rows(scores)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)

    def rms_norm_heads(self, heads: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """Each head_dim row of heads [tokens, n, head_dim] (a view into qkv) normalized in place."""
        self.ops.rms_norm_heads(heads, weight, eps)

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, norm(hidden + delta)); the sum is written into `hidden`."""
        return hidden, self.ops.add_rms_norm(hidden, delta, weight, eps)

    def rotate_and_store(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rotary,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k of qkv [tokens, heads + 2 * kv_heads, head_dim], store k and v in the
        pools; returns (q, k) as views of qkv."""
        self.ops.rope_and_store(qkv, num_heads, cos, signed_sin, k_buffer, v_buffer, out_cache_loc)
        return qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]

    def gated_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        quantized: QuantizedProjection | None,
        activation: str,
        prompt_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """act(x @ gate.T) * (x @ up.T) for weight = [gate; up] (activation "silu" or
        "gelu_tanh"): one call where the blocks are in one format and the halves in whole row
        groups, else the matmul then the activation (the same bits either way)."""
        code = Activation.GELU_TANH if activation == "gelu_tanh" else Activation.SILU
        if isinstance(quantized, QuantizedLinearWeight) and quantized.out_features % (2 * self.ops.row_group) == 0:
            half = quantized.out_features // 2
            return self.ops.qgemm_gated(x, quantized.format, quantized.packed, half, code, prompt_rows)
        gate_up = self.linear(x, weight, quantized, prompt_rows=prompt_rows)
        return self.ops.gelu_tanh_mul(gate_up) if code is Activation.GELU_TANH else self.ops.silu_mul(gate_up)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        metadata: AttentionMetadata,
        options: AttentionOptions,
    ) -> torch.Tensor:
        """[num_tokens, num_heads * head_dim]; every token reads the pool at its position."""
        num_tokens, num_heads, head_dim = q.shape
        out = self.ops.decode_attention(
            q,
            k_buffer,
            v_buffer,
            metadata.decode_slots,
            metadata.decode_lens,
            metadata.decode_max_seq_len,
            metadata.decode_slot_rows,
            scale=options.scale,
            sliding_window=options.sliding_window,
            softcap=options.softcap,
            prompt_rows=metadata.prompt_rows,
        )
        return out.view(num_tokens, num_heads * head_dim)


class TorchBackend:
    name = "torch"
    every_token_decodes = False
    isa = None

    argmax_rows = staticmethod(TORCH_ARGMAX_ROWS)  # the sampler's own default

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        quantized: QuantizedProjection | None,
        bias: torch.Tensor | None = None,
        prompt_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if quantized is not None:
            raise ValueError("block-quantized weights need the C kernels (KernelBackend)")
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, eps)

    def rms_norm_heads(self, heads: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        heads.copy_(F.rms_norm(heads, weight.shape, weight, eps))

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = hidden + delta
        return hidden, self.rms_norm(hidden, weight, eps)

    def rotate_and_store(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rotary,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        out_cache_loc: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_qk_heads = num_heads + num_kv_heads
        # q and k are rotated together: one set of ops instead of two.
        qk = rotary.rotate(qkv[:, :num_qk_heads], cos.unsqueeze(1), signed_sin.unsqueeze(1))
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        _store_rows(k_buffer, out_cache_loc, k)
        _store_rows(v_buffer, out_cache_loc, qkv[:, num_qk_heads:])
        return q, k

    def gated_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        quantized: QuantizedProjection | None,
        activation: str,
        prompt_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        gate_up = self.linear(x, weight, quantized, prompt_rows=prompt_rows)
        if activation == "gelu_tanh":
            return gelu_tanh_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        metadata: AttentionMetadata,
        options: AttentionOptions,
    ) -> torch.Tensor:
        return torch_attention(q, k, v, k_buffer, v_buffer, metadata, options)


def _store_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[slots] = rows in the pool's dtype (torch's CPU index_copy_ has no float8 kernel:
    a float8 pool takes the rounded rows' bytes)."""
    rows = rows.to(pool.dtype)
    if pool.dtype == torch.float8_e5m2:
        pool.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        pool.index_copy_(0, slots, rows)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up (GELU's tanh form, Gemma's GeGLU) for gate_up = [gate | up]: torch's
    elementwise ops (the kernel backend has its own, which the one-call layers share)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


Backend = KernelBackend | TorchBackend
