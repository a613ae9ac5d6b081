"""The building blocks of a Llama-family decoder: norm, rotary embedding, projections.

Projections are fused (q/k/v into one matrix, gate/up into one) because at small batch a
decode step costs about one kernel launch per matmul, not FLOPs. Each module holds the
model's backend (backend.py), which decides how its ops run.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from sluice.model.backend import Backend
from sluice.model.quantized_linear import QuantizedProjection


def _frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Filled by LlamaForCausalLM.load_weights; `empty` avoids a useless random init.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, backend: Backend) -> None:
        super().__init__()
        self.weight = _frozen(hidden_size, dtype=dtype)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden]."""
        return self.backend.rms_norm(x, self.weight, self.eps)

    def norm_heads(self, heads: torch.Tensor) -> None:
        """Each head_dim row of heads [tokens, n, head_dim], a view into qkv, normalized in place."""
        self.backend.rms_norm_heads(heads, self.weight, self.eps)

    def add_and_norm(self, hidden: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, norm(hidden + delta)); the sum may be written into `hidden`."""
        return self.backend.add_rms_norm(hidden, delta, self.weight, self.eps)


class QKVProjection(nn.Module):
    """q, k and v projections as one matmul; output rows are [q heads | k heads | v heads]."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        dtype: torch.dtype,
        backend: Backend,
    ) -> None:
        super().__init__()
        out_features = (num_heads + 2 * num_kv_heads) * head_dim
        self.weight = _frozen(out_features, hidden_size, dtype=dtype)
        self.bias = _frozen(out_features, dtype=dtype) if bias else None
        self.quantized: QuantizedProjection | None = None
        self.backend = backend

    def forward(self, x: torch.Tensor, prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.quantized, self.bias, prompt_rows)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, backend: Backend) -> None:
        super().__init__()
        self.weight = _frozen(out_features, in_features, dtype=dtype)
        self.quantized: QuantizedProjection | None = None
        self.backend = backend

    def forward(self, x: torch.Tensor, prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.quantized, prompt_rows=prompt_rows)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up stacked into one weight: SwiGLU (act =
    silu) or GeGLU (act = GELU's tanh form, Gemma)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str, dtype: torch.dtype, backend: Backend
    ) -> None:
        super().__init__()
        self.gate_up_weight = _frozen(2 * intermediate_size, hidden_size, dtype=dtype)
        self.down_weight = _frozen(hidden_size, intermediate_size, dtype=dtype)
        self.gate_up_quantized: QuantizedProjection | None = None
        self.down_quantized: QuantizedProjection | None = None
        self.backend = backend
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"MLP activation {activation!r} is not supported; supported: silu, gelu_tanh")
        self.activation = activation

    def forward(self, x: torch.Tensor, prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        activated = self.backend.gated_linear(
            x, self.gate_up_weight, self.gate_up_quantized, self.activation, prompt_rows=prompt_rows
        )
        return self.backend.linear(activated, self.down_weight, self.down_quantized, prompt_rows=prompt_rows)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions up to context_len, computed a block of positions at a time
    as tokens first reach them: a 128 K-token context's full tables would be hundreds of MB at
    Gemma's head size, most of them never read. Each block is computed on its own, so a
    position's values never depend on how far the tables had grown.

    Uses the rotate-half (NeoX) layout of transformers' Llama, so HF checkpoints and
    un-permuted GGUF weights apply as they are.
    """

    cos: torch.Tensor  # buffers, [positions computed so far, head_dim]
    signed_sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
        context_len: int,
        dtype: torch.dtype,
        rotary_dim: int | None = None,
    ) -> None:
        """rotary_dim: how many dimensions of a head rotate (None: all). The others get
        frequency 0 (cos 1, sin 0); weights.py orders each head so that the rotating ones
        pair up as rotate_half over the whole head pairs them."""
        super().__init__()
        self.head_dim, self.rope_theta, self.rope_scaling = head_dim, rope_theta, rope_scaling or {}
        self.context_len, self.dtype = context_len, dtype
        self.rotating = head_dim if rotary_dim is None else rotary_dim
        self.half_dim = head_dim // 2
        empty = torch.empty(0, head_dim, dtype=dtype)
        self.register_buffer("cos", empty, persistent=False)
        self.register_buffer("signed_sin", empty.clone(), persistent=False)
        self._extend_to(min(context_len, _ROTARY_BLOCK))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token, [num_tokens, head_dim] (unsqueeze(1) broadcasts over heads)."""
        if len(positions):
            self._extend_to(min(int(positions.max()) + 1, self.context_len))
        return self.cos[positions], self.signed_sin[positions]

    def _extend_to(self, count: int) -> None:
        """Tables for positions [0, count), whole blocks at a time."""
        have = len(self.cos)
        if count <= have:
            return
        blocks = [self._block(start) for start in range(have, count, _ROTARY_BLOCK)]
        self.cos = torch.cat([self.cos, *(cos for cos, _ in blocks)])
        self.signed_sin = torch.cat([self.signed_sin, *(signed_sin for _, signed_sin in blocks)])

    def _block(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of positions [start, start + _ROTARY_BLOCK), within the context."""
        positions = torch.arange(start, min(start + _ROTARY_BLOCK, self.context_len), dtype=torch.float32)
        rotating = self.rotating
        if self.rope_scaling.get("rope_type") == "longrope":
            freqs, scale = _longrope_freqs(rotating, self.rope_theta, self.rope_scaling, positions)
        else:
            inv_freq, scale = _scaled_inv_freq(rotating, self.rope_theta, self.rope_scaling)
            freqs = torch.outer(positions, inv_freq)
        passing = (self.head_dim - rotating) // 2
        # The sign of rotate_half is folded into sin: rotate_half(x) * sin ==
        # roll(x, half) * [-sin, sin], which saves a negation and a concat per layer.
        cos = torch.cat((freqs, freqs), dim=-1).cos() * scale
        signed_sin = torch.cat((-freqs, freqs), dim=-1).sin() * scale
        if passing:  # dimensions that do not rotate: cos 1 (LongRoPE's and YaRN's scale is not theirs), sin 0
            cos, signed_sin = (
                torch.cat([table[:, : rotating // 2], fill, table[:, rotating // 2 :], fill], dim=-1)
                for table, fill in (
                    (cos, torch.ones(len(positions), passing)),
                    (signed_sin, torch.zeros(len(positions), passing)),
                )
            )
        return cos.to(self.dtype), signed_sin.to(self.dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [num_tokens, num_heads, head_dim]."""
        return torch.addcmul(x * cos, torch.roll(x, self.half_dim, dims=-1), signed_sin)


_ROTARY_BLOCK = 4096  # positions whose rotary tables are computed together


def _scaled_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """The rotary frequencies of a head's head_dim rotating dimensions, and the factor cos and
    sin are scaled by (1 but for YaRN)."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, rope_theta, scaling)
    if rope_type == "frequency_factors":  # a GGUF's rope_freqs tensor: one divisor per frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {len(factors)} factors, not head_dim / 2 = {len(inv_freq)}")
        return inv_freq / factors, 1.0
    raise ValueError(
        f"rope_scaling.rope_type {rope_type!r} is not supported; supported: linear, llama3, longrope, yarn"
    )


def _longrope_freqs(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any], positions: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by a per-dimension factor, the short factors at
    positions below original_max_position_embeddings and the long ones from there on, and
    cos/sin scaled by the attention factor. Chosen per position (as vLLM does), so a token's
    rotation never depends on how long its sequence has grown; transformers instead switches
    every position to the long factors once a sequence passes that length."""
    original = rope_scaling["original_max_position_embeddings"]
    factor = rope_scaling["factor"]
    scale = rope_scaling.get("attention_factor") or (
        1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    short = 1.0 / (torch.tensor(rope_scaling["short_factor"], dtype=torch.float32) * rope_theta**exponents)
    long = 1.0 / (torch.tensor(rope_scaling["long_factor"], dtype=torch.float32) * rope_theta**exponents)
    inv_freq = torch.where((positions < original).unsqueeze(1), short, long)
    return positions.unsqueeze(1) * inv_freq, float(scale)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling, as transformers computes it."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    original_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context_len / low_freq_factor
    high_freq_wavelen = original_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the trained one (eq. 21)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(
    inv_freq: torch.Tensor, rotating: int, rope_theta: float, rope_scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5 and Qwen3 past 32 K tokens, GGUFs with rope.scaling.type yarn), as
    transformers and llama.cpp compute it: frequencies that turn fewer than beta_slow times
    over the trained context are divided by `factor`, those that turn more than beta_fast
    times are kept, and a linear ramp over the dimensions between mixes the two; cos and sin
    are scaled by the attention factor (0.1 ln(factor) + 1 unless the config gives one)."""
    factor = rope_scaling["factor"]
    original = rope_scaling["original_max_position_embeddings"]
    beta_fast = rope_scaling.get("beta_fast") or 32.0
    beta_slow = rope_scaling.get("beta_slow") or 1.0

    def dimension_turning(turns: float) -> float:
        """The (fractional) dimension pair whose frequency turns `turns` times in `original` positions."""
        return rotating * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotating - 1)
    ramp = ((torch.arange(rotating // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    kept = 1 - ramp  # 1: the frequency as trained, 0: divided by factor
    mixed = inv_freq / factor * (1 - kept) + inv_freq * kept

    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return mixed, float(attention_factor)
