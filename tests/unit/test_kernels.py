"""The C kernels against plain torch on random data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels import ops
from sluice.kernels.loader import cpu_supports_kernels
from sluice.model.quantized_linear import BlockFormat, QuantizedLinearWeight

# Where the CPU has AVX2 the kernels must build (gcc is part of the set-up): a failed build fails here.
pytestmark = pytest.mark.skipif(not cpu_supports_kernels(), reason="the C kernels need AVX2 and FMA")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("format", list(BlockFormat))
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8])
def test_quantized_matmul_matches_dense_matmul_of_the_same_blocks(format, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=generator) * 0.05
    x = torch.randn(rows, 96, generator=generator)
    quantized = QuantizedLinearWeight.quantize(weight, format)
    # The only error left is x's own rounding to int8 blocks (scale max|x| / 127).
    assert relative_error(quantized.matmul(x), F.linear(x, quantized.dequantize())) < 1e-2


@pytest.mark.parametrize("format", list(BlockFormat))
def test_quantizing_blocks_is_close_and_idempotent(format):
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    once = QuantizedLinearWeight.quantize(weight, format).dequantize()
    step = 2.0 / 127 if format is BlockFormat.Q8_0 else 1.0 / 15  # half a step of the block's range
    assert (once - weight).abs().max() <= step * weight.abs().max()
    # Weights that already are blocks (a dequantized GGUF tensor) come back exactly.
    twice = QuantizedLinearWeight.quantize(once, format).dequantize()
    torch.testing.assert_close(twice, once, rtol=0, atol=1e-6)


def test_quantize_rejects_a_width_that_is_not_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedLinearWeight.quantize(torch.zeros(4, 40), BlockFormat.Q8_0)


def test_rms_norm_and_fused_add_match_torch():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 576, generator=generator) * 3
    delta = torch.randn(5, 576, generator=generator)
    weight = torch.rand(576, generator=generator) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5))
    hidden = x.clone()
    normed = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    torch.testing.assert_close(hidden, x + delta)
    torch.testing.assert_close(normed, F.rms_norm(x + delta, (576,), weight, 1e-5))


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 64), (9, 3, 64), (8, 2, 128), (4, 4, 32), (4, 1, 20)])
def test_decode_attention_reads_each_request_slots_in_place(heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(2)
    num_slots = 100
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator)
    seq_lens = [7, 31, 1, 16]  # shorter than, not a multiple of, and a multiple of 8 tokens
    max_len = max(seq_lens)
    request_slots = [torch.randperm(num_slots - 1, generator=generator)[:n] + 1 for n in seq_lens]
    padded = torch.zeros(len(seq_lens), max_len, dtype=torch.int64)
    for row, slots in enumerate(request_slots):
        padded[row, : len(slots)] = slots
    # q as a strided view, the way the model passes the q part of its qkv projection.
    qkv = torch.randn(len(seq_lens), heads + 2 * kv_heads, head_dim, generator=generator)
    q = qkv[:, :heads]

    out = ops.decode_attention(q, k_pool, v_pool, padded.view(-1), torch.tensor(seq_lens), max_len)

    for row, slots in enumerate(request_slots):
        keys = k_pool[slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [heads, len, dim]
        values = v_pool[slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[row].unsqueeze(1), keys, values).squeeze(1)
        torch.testing.assert_close(out[row], expected, rtol=1e-4, atol=1e-5)


def test_rope_and_store_matches_the_torch_rotation_and_copy():
    from sluice.model.layers import RotaryEmbedding

    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, tokens = 4, 2, 64, 5
    rotary = RotaryEmbedding(head_dim, 10000.0, None, context_len=64, dtype=torch.float32)
    cos, signed_sin = rotary.lookup(torch.tensor([0, 3, 7, 8, 63]))
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator)
    slots = torch.tensor([9, 2, 5, 1, 7])
    k_pool, v_pool = torch.zeros(10, kv_heads, head_dim), torch.zeros(10, kv_heads, head_dim)

    expected_qk = rotary.apply(qkv[:, : heads + kv_heads], cos.unsqueeze(1), signed_sin.unsqueeze(1))
    expected_v = qkv[:, heads + kv_heads :].clone()
    ops.rope_and_store(qkv, heads, cos, signed_sin, k_pool, v_pool, slots)

    torch.testing.assert_close(qkv[:, : heads + kv_heads], expected_qk)
    torch.testing.assert_close(k_pool[slots], expected_qk[:, heads:])
    torch.testing.assert_close(v_pool[slots], expected_v)
    assert k_pool[0].abs().sum() == 0  # untouched slots stay as they were


def test_silu_mul_matches_torch():
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(4)) * 4
    gate, up = gate_up.split(40, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up)
