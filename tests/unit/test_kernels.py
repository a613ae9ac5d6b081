"""The C kernels against plain torch on random data, for every instruction set this CPU has
(AVX2 always where the kernels run; AVX-512 VNNI where the CPU has it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sluice.kernels import contract
from sluice.kernels.contract import Activation
from sluice.kernels.cpu import DISABLE_ENV, ISA_NAMES, supported_isas
from sluice.kernels.loader import load_kernels
from sluice.kernels.ops import KernelOps
from sluice.model.block_rows import SUPER_BLOCK_SCALES, BlockFormat
from sluice.model.gguf_blocks import block_rows
from sluice.model.layers import RotaryEmbedding
from sluice.model.quantized_linear import QuantizedLinearWeight
from tests.gguf_files import random_blocks

SUPPORTED = [isa.name for isa in supported_isas()]
# Where the CPU has an instruction set, its build must work (gcc is part of the set-up): a
# failed build or self-test fails here instead of being skipped.
ISA_PARAMS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in SUPPORTED, reason=f"this CPU lacks {name}"))
    for name in ISA_NAMES
]


@pytest.fixture(params=ISA_PARAMS)
def ops(request) -> KernelOps:
    return KernelOps(load_kernels(request.param))


ROUNDED_FORMATS = [BlockFormat.Q8_0, BlockFormat.Q4_1, BlockFormat.Q5_1]  # the formats a float weight can be rounded to


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def rounding_bound(format: BlockFormat) -> float:
    """The relative error x's rounding to int8 (scale max|x| / 127) may leave on random data:
    0.14-0.22% with a scale per 32-value block (q8_0, q4_1, q5_1), 0.6-1.3% per 256-value
    super-block (q6_k, q4_k, q5_k, as llama.cpp's q8_K; 0.3-0.9% with a scale a block, as until
    2026-12-05)."""
    return 2e-2 if format in SUPER_BLOCK_SCALES else 1e-2


def block_weight(format: BlockFormat, out_features: int, in_features: int, ops: KernelOps, seed: int):
    """A random [out, in] weight in `format`: floats rounded to its blocks, or for the
    super-block formats (which only a GGUF holds) random blocks of that GGUF type as a file
    holds them, `in_features` rounded up to whole super-blocks. -> (the weight, in_features)"""
    if format not in ROUNDED_FORMATS:
        in_features = -(-in_features // 256) * 256
        raw = random_blocks(out_features, in_features, format.name, seed=seed)
        rows = block_rows(raw, format.name, (out_features, in_features), format)
        return QuantizedLinearWeight.from_rows(rows, ops), in_features
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QuantizedLinearWeight.quantize(weight, format, ops), in_features


@pytest.mark.parametrize("format", list(BlockFormat))
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 17, 64, 300])
def test_quantized_matmul_matches_dense_matmul_of_the_same_blocks(ops, format, rows):
    quantized, in_features = block_weight(format, 203, 96, ops, seed=rows)  # 203: the last row group is partial
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    # The only error left is x's own rounding to int8.
    assert relative_error(quantized.matmul(x), F.linear(x, quantized.dequantize())) < rounding_bound(format)


def prompt_flags(rows: int) -> torch.Tensor:
    """Two of every three rows flagged as prompt rows, the rest as decode rows."""
    return torch.arange(rows) % 3 != 1


@pytest.mark.parametrize("format", list(BlockFormat))
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
def test_prompt_rows_match_the_dense_matmul_and_decode_rows_keep_their_bits(ops, format, rows):
    """An AMX-BF16 build multiplies prompt rows on bf16 tiles (activations and weights rounded
    to bf16, not x to int8 blocks: nearer the float product); on every build the other rows
    give exactly what they give without flags, and elsewhere the flags change nothing."""
    quantized, in_features = block_weight(format, 203, 96, ops, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    flags = prompt_flags(rows)
    flagged = quantized.matmul(x, flags)
    unflagged = quantized.matmul(x)
    assert relative_error(flagged, F.linear(x, quantized.dequantize())) < rounding_bound(format)
    assert torch.equal(flagged[~flags], unflagged[~flags])
    if ops.isa != "amx_bf16":
        assert torch.equal(flagged, unflagged)
    else:
        assert not torch.equal(flagged[flags], unflagged[flags]), "the prompt rows did not take the bf16 tiles"
        # All prompt rows too: the last 32-row tile is padded.
        assert torch.equal(quantized.matmul(x, torch.ones(rows, dtype=torch.bool))[flags], flagged[flags])


@pytest.mark.parametrize("format", list(BlockFormat))
def test_a_prompt_row_gives_the_same_bits_alone_and_in_any_batch(ops, format):
    quantized, in_features = block_weight(format, 100, 64, ops, seed=7)
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(7))
    flags = prompt_flags(300)
    batched = quantized.matmul(x, flags)
    for row in (1, 2, 151, 299):
        assert torch.equal(quantized.matmul(x[row : row + 1], flags[row : row + 1])[0], batched[row])
    assert torch.equal(quantized.matmul(x[5:22], flags[5:22]), batched[5:22])


@pytest.mark.parametrize("format", list(BlockFormat))
@pytest.mark.parametrize(("in_features", "rows", "chunk"), [(4352, 300, 256), (1024, 600, 512)])
def test_prompt_rows_past_one_k_slice_and_one_row_chunk_keep_their_bits(ops, format, in_features, rows, chunk):
    """K = 4,352 is three of the bf16 tiles' K slices (2,048 weights, the last one partial),
    whose float sums wait in memory between slices, and 300 rows two 256-row chunks; at K =
    1,024 a chunk is 512 rows, so 600 rows are two."""
    quantized, in_features = block_weight(format, 40, in_features, ops, seed=11)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(11))
    flags = torch.ones(rows, dtype=torch.bool)
    batched = quantized.matmul(x, flags)
    assert relative_error(batched, F.linear(x, quantized.dequantize())) < rounding_bound(format)
    for row in (0, chunk - 1, chunk, rows - 1):
        assert torch.equal(quantized.matmul(x[row : row + 1], flags[:1])[0], batched[row])
    assert torch.equal(quantized.matmul(x[chunk - 6 : chunk + 14], flags[:20]), batched[chunk - 6 : chunk + 14])


@pytest.mark.parametrize("activation", [Activation.SILU, Activation.GELU_TANH])
@pytest.mark.parametrize("format", list(BlockFormat))
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
def test_the_gated_matmul_gives_the_bits_of_the_matmul_then_the_activation(ops, format, rows, activation):
    """The gated MLP's [gate; up] projection and its activation in one call: prompt rows (on an
    AMX-BF16 build's tiles, gated on the way out), decode rows, and both in one batch give
    exactly what qgemm then silu_mul / gelu_tanh_mul give. K = 4,352: three K slices."""
    intermediate = 3 * ops.row_group
    quantized, in_features = block_weight(format, 2 * intermediate, 4352 if rows == 300 else 96, ops, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)) * 3
    activate = ops.gelu_tanh_mul if activation is Activation.GELU_TANH else ops.silu_mul
    for flags in (None, prompt_flags(rows), torch.ones(rows, dtype=torch.bool)):
        gated = ops.qgemm_gated(x, quantized.format, quantized.packed, intermediate, activation, flags)
        assert torch.equal(gated, activate(quantized.matmul(x, flags)))
    with pytest.raises(ValueError, match="multiple of"):
        ops.qgemm_gated(x, quantized.format, quantized.packed, intermediate - 1, activation)


@pytest.mark.parametrize("format", list(BlockFormat))
def test_a_row_gives_the_same_bits_alone_and_in_any_batch(ops, format):
    quantized, in_features = block_weight(format, 100, 64, ops, seed=5)
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(5))
    batched = quantized.matmul(x)
    for row in (0, 3, 150, 299):
        assert torch.equal(quantized.matmul(x[row : row + 1])[0], batched[row])
    assert torch.equal(quantized.matmul(x[5:22]), batched[5:22])


@pytest.mark.parametrize("format", [BlockFormat.Q4_1, BlockFormat.Q5_1])
def test_a_batch_past_eight_blocks_gives_the_bits_of_single_rows(ops, format):
    """A batch's q4_1/q5_1 blocks are unpacked once, eight at a time standing in for a
    super-block: K = 320 (ten blocks, not whole super-blocks) reaches past the first eight."""
    quantized, in_features = block_weight(format, 40, 320, ops, seed=7)
    x = torch.randn(64, in_features, generator=torch.Generator().manual_seed(7))
    batched = quantized.matmul(x)
    for row in (0, 33, 63):
        assert torch.equal(quantized.matmul(x[row : row + 1])[0], batched[row])
    assert relative_error(batched, F.linear(x, quantized.dequantize())) < 1e-2


# Where each GGUF block type keeps its quants (bytes start..end of a block): every bit set there makes
# every quant its largest (q8_0's 0x7F: 127).
QUANT_BYTES = {"Q8_0": (2, 34, 0x7F), "Q4_1": (4, 20, 0xFF), "Q5_1": (4, 24, 0xFF)}
QUANT_BYTES |= {"Q4_K": (16, 144, 0xFF), "Q5_K": (16, 176, 0xFF), "Q6_K": (0, 192, 0xFF)}


@pytest.mark.parametrize("format", list(BlockFormat))
@pytest.mark.parametrize("rows", [1, 4, 17])
def test_the_largest_quants_against_equal_activations_stay_exact(ops, format, rows):
    """Equal activations quantize to 127 each; against the largest quants every integer dot is
    at its bound (AVX2's int16 lanes wrapped here for the 5-bit formats once)."""
    import gguf

    raw = random_blocks(24, 512, format.name, seed=rows)
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[format.name]][1]
    start, end, value = QUANT_BYTES[format.name]
    raw.reshape(-1, block_bytes)[:, start:end] = value
    quantized = QuantizedLinearWeight.from_rows(block_rows(raw, format.name, (24, 512), format), ops)
    x = torch.ones(rows, 512)
    assert relative_error(quantized.matmul(x), F.linear(x, quantized.dequantize())) < 1e-5


@pytest.mark.skipif(len(SUPPORTED) < 2, reason="needs a CPU with AVX-512 VNNI to compare against AVX2")
@pytest.mark.parametrize("format", list(BlockFormat))
@pytest.mark.parametrize("rows", [5, 11, 37])
def test_every_build_gives_the_same_bits(format, rows):
    """Each block's integer dot is exact on all (AMX's tiles included: 5 rows take the VNNI
    code there, 11 rows one partial tile, 37 rows two 16-row tiles and a partial one), and the
    float operations are the same in the same order: the instruction set never changes an
    answer."""
    results = []
    for name in SUPPORTED:
        quantized, in_features = block_weight(format, 77, 160, KernelOps(load_kernels(name)), seed=6)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(6))
        assert quantized.packed.numel() > 0
        results.append(quantized.matmul(x))
    assert all(torch.equal(results[0], result) for result in results[1:])


@pytest.mark.parametrize("format", ROUNDED_FORMATS)
def test_quantizing_blocks_is_close_and_idempotent(ops, format):
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    once = QuantizedLinearWeight.quantize(weight, format, ops).dequantize()
    # half a step of the block's range
    step = {BlockFormat.Q8_0: 2.0 / 127, BlockFormat.Q4_1: 1.0 / 15, BlockFormat.Q5_1: 1.0 / 31}[format]
    assert (once - weight).abs().max() <= step * weight.abs().max()
    # Weights that already are blocks (a dequantized GGUF tensor) come back exactly.
    twice = QuantizedLinearWeight.quantize(once, format, ops).dequantize()
    torch.testing.assert_close(twice, once, rtol=0, atol=1e-6)


def test_quantize_rejects_a_width_that_is_not_whole_blocks(ops):
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedLinearWeight.quantize(torch.zeros(4, 40), BlockFormat.Q8_0, ops)


def test_wrappers_refuse_wrong_tensors_instead_of_reading_memory(ops):
    quantized = QuantizedLinearWeight.quantize(torch.randn(16, 64), BlockFormat.Q8_0, ops)
    with pytest.raises(TypeError, match="float32"):
        quantized.matmul(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="features"):
        quantized.matmul(torch.randn(2, 96))
    with pytest.raises(ValueError, match="norm weight"):
        ops.rms_norm(torch.randn(2, 64), torch.ones(32), 1e-5)
    with pytest.raises(TypeError, match="KV pool"):
        ops.decode_attention(
            torch.randn(1, 2, 8),
            torch.zeros(4, 1, 8, dtype=torch.int32),
            torch.zeros(4, 1, 8, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            1,
        )


@pytest.mark.parametrize("cols", [1, 7, 8, 49152 + 3])
def test_argmax_rows_gives_torchs_indices_ties_and_nans_included(ops, cols):
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(12, cols, generator=generator)
    x[1] = float("-inf")  # a row every token of which is banned
    x[2, cols // 2 :] = float("inf")  # ties: the first is taken
    x[3, cols - 1] = float("nan")  # a NaN is the largest
    x[4, cols // 3] = float("nan")
    x[4, cols - 1] = float("nan")
    x[5] = 0.0
    x[5, cols // 2] = -0.0
    x[6] = x[6].round()  # many equal values
    x[7, : cols // 2 + 1] = x[7].max() + 1.0  # the largest in the vector part and the tail
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    assert torch.equal(ops.argmax_rows(x[3:9:2]), x[3:9:2].argmax(-1))  # rows taken out of a batch


def test_rms_norm_and_fused_add_match_torch(ops):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 576, generator=generator) * 3
    delta = torch.randn(5, 576, generator=generator)
    weight = torch.rand(576, generator=generator) + 0.5
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5))
    hidden = x.clone()
    normed = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    torch.testing.assert_close(hidden, x + delta)
    torch.testing.assert_close(normed, F.rms_norm(x + delta, (576,), weight, 1e-5))


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_rms_norm_heads_normalizes_some_heads_of_qkv_rows_in_place(ops, tokens):
    """Qwen3's per-head q/k norms: heads inside qkv rows, the rest of each row untouched, the
    same bits as rms_norm of those heads gathered into rows."""
    generator = torch.Generator().manual_seed(3)
    heads, head_dim = 7, 40
    qkv = torch.randn(tokens, heads, head_dim, generator=generator) * 2
    weight = torch.rand(head_dim, generator=generator) + 0.5
    original, expected = qkv.clone(), qkv.clone()
    expected[:, 2:5] = ops.rms_norm(qkv[:, 2:5].reshape(-1, head_dim), weight, 1e-6).view(tokens, 3, head_dim)
    ops.rms_norm_heads(qkv[:, 2:5], weight, 1e-6)
    assert torch.equal(qkv, expected)
    torch.testing.assert_close(qkv[:, 2:5], F.rms_norm(original[:, 2:5], (head_dim,), weight, 1e-6))
    with pytest.raises(ValueError, match="contiguous heads"):
        ops.rms_norm_heads(qkv.transpose(0, 1), weight, 1e-6)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 64), (9, 3, 64), (8, 2, 128), (4, 4, 32), (4, 1, 20)])
def test_decode_attention_reads_each_request_slots_in_place(ops, heads, kv_heads, head_dim, kv_dtype):
    generator = torch.Generator().manual_seed(2)
    num_slots = 100
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(kv_dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(kv_dtype)
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
        # The reference reads the same (rounded) pool values, widened to float32.
        keys = k_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [heads, len, dim]
        values = v_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[row].unsqueeze(1), keys, values).squeeze(1)
        torch.testing.assert_close(out[row], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.float8_e5m2])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 20)])
def test_a_decode_step_of_many_requests_gives_each_the_bits_it_gets_alone(ops, heads, kv_heads, head_dim, kv_dtype):
    """With many requests a task takes all the KV heads of one (its rows prefetched whole);
    with one, a task per KV head. Each request's result must not depend on which."""
    generator = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(1, 90, (40,), generator=generator)
    max_len = int(seq_lens.max())
    num_slots = int(seq_lens.sum()) + 1
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(kv_dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(kv_dtype)
    padded = torch.zeros(len(seq_lens), max_len, dtype=torch.int64)
    for row, slots in enumerate(torch.randperm(num_slots - 1, generator=generator).add(1).split(seq_lens.tolist())):
        padded[row, : len(slots)] = slots
    q = torch.randn(len(seq_lens), heads, head_dim, generator=generator)
    together = ops.decode_attention(q, k_pool, v_pool, padded.view(-1), seq_lens, max_len)
    for row in range(len(seq_lens)):
        alone = ops.decode_attention(
            q[row : row + 1], k_pool, v_pool, padded[row].clone(), seq_lens[row : row + 1], max_len
        )
        assert torch.equal(together[row], alone[0]), f"request {row}"
        slots = padded[row, : int(seq_lens[row])]
        keys = k_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        values = v_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[row].unsqueeze(1), keys, values).squeeze(1)
        torch.testing.assert_close(together[row], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.float8_e5m2])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 20), (4, 1, 32)])
def test_decode_steps_sharing_a_cached_prefix_give_each_the_bits_it_gets_alone(
    ops, heads, kv_heads, head_dim, kv_dtype
):
    """Decode queries whose slot lists start alike (a prompt prefix the radix cache shares)
    go in blocks that read and widen each common tile once; each must still get the bits it
    gets alone, with the prompt block of another request in the same call or not."""
    generator = torch.Generator().manual_seed(7)
    long_prefix, short_prefix = torch.arange(1, 201), torch.arange(201, 271)  # 3 tiles and a part; 1 and a part
    lists = []
    for i in range(44):
        prefix = long_prefix if i % 11 < 8 else short_prefix if i % 11 < 10 else torch.arange(0)
        own = int(torch.randint(0, 90, (1,), generator=generator)) if i % 7 else 0  # some end with the prefix
        lists.append(torch.cat([prefix, 300 + 100 * i + torch.arange(max(own, 1 - len(prefix)))]))
    prompt = 5000 + torch.arange(40)
    seq_lens = torch.tensor([len(slots) for slots in lists])
    max_len = int(seq_lens.max())
    num_slots = 5100
    k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(kv_dtype)
    v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(kv_dtype)
    padded = torch.zeros(len(lists) + 1, max_len, dtype=torch.int64)
    for row, slots in enumerate([*lists, prompt]):
        padded[row, : len(slots)] = slots
    q = torch.randn(len(lists) + len(prompt), heads, head_dim, generator=generator)
    decodes = ops.decode_attention(q[: len(lists)], k_pool, v_pool, padded[:-1].reshape(-1), seq_lens, max_len)
    # The same decode queries after a prompt's 40 tokens, rows given per query.
    slot_rows = torch.cat([torch.full((len(prompt),), len(lists)), torch.arange(len(lists))])
    mixed_lens = torch.cat([torch.arange(1, len(prompt) + 1), seq_lens])
    mixed_q = torch.cat([q[len(lists) :], q[: len(lists)]])
    mixed = ops.decode_attention(mixed_q, k_pool, v_pool, padded.view(-1), mixed_lens, max_len, slot_rows)
    for row, slots in enumerate(lists):
        alone = ops.decode_attention(
            q[row : row + 1], k_pool, v_pool, padded[row].clone(), seq_lens[row : row + 1], max_len
        )
        assert torch.equal(decodes[row], alone[0]), f"request {row}"
        assert torch.equal(mixed[len(prompt) + row], alone[0]), f"request {row} beside a prompt"
        keys = k_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        values = v_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[row].unsqueeze(1), keys, values).squeeze(1)
        torch.testing.assert_close(decodes[row], expected, rtol=1e-4, atol=1e-5)


class Prompts:
    """Whole prompts of random K/V in one pool (slots shuffled) and a query per token, each
    token seeing its prompt up to itself, as a prefill does."""

    def __init__(self, generator, lengths: list[int], heads: int, kv_heads: int, head_dim: int, kv_dtype) -> None:
        num_slots = sum(lengths) + 1
        self.k_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(kv_dtype)
        self.v_pool = torch.randn(num_slots, kv_heads, head_dim, generator=generator).to(kv_dtype)
        self.request_slots = list(torch.randperm(num_slots - 1, generator=generator).add(1).split(lengths))
        self.max_len = max(lengths)
        self.padded = torch.zeros(len(lengths), self.max_len, dtype=torch.int64)
        for row, slots in enumerate(self.request_slots):
            self.padded[row, : len(slots)] = slots
        self.q = torch.randn(sum(lengths), heads, head_dim, generator=generator)
        self.slot_rows = torch.cat([torch.full((n,), row) for row, n in enumerate(lengths)])
        self.seq_lens = torch.cat([torch.arange(1, n + 1) for n in lengths])

    def attend_together(self, ops: KernelOps, **options) -> torch.Tensor:
        slots = self.padded.view(-1)
        return ops.decode_attention(
            self.q, self.k_pool, self.v_pool, slots, self.seq_lens, self.max_len, self.slot_rows, **options
        )

    def assert_each_token_as_a_decode_step(self, ops: KernelOps, together: torch.Tensor, **options) -> None:
        for i in range(len(self.q)):
            slots, seq_len = self.padded[self.slot_rows[i]].clone(), self.seq_lens[i : i + 1]
            alone = ops.decode_attention(
                self.q[i : i + 1], self.k_pool, self.v_pool, slots, seq_len, self.max_len, **options
            )
            assert torch.equal(together[i], alone[0]), f"query {i}"


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (16, 2, 64), (8, 2, 128), (4, 4, 32), (4, 1, 20)])
def test_prompt_attention_gives_each_token_the_bits_of_a_decode_step_at_its_position(
    ops, heads, kv_heads, head_dim, kv_dtype
):
    """Prompt tokens go in blocks that share each K/V tile (their keys transposed once); each
    token's result must be the bits it gets alone, as a decode step, and causal attention."""
    # A long prompt (full and partial blocks and tiles) and a short one beside it.
    prompts = Prompts(torch.Generator().manual_seed(4), [150, 7], heads, kv_heads, head_dim, kv_dtype)
    together = prompts.attend_together(ops)
    prompts.assert_each_token_as_a_decode_step(ops, together)
    k_pool, v_pool, q = prompts.k_pool, prompts.v_pool, prompts.q
    first = 0
    for slots in prompts.request_slots:
        n = len(slots)
        keys = k_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        values = v_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[first : first + n].transpose(0, 1), keys, values, is_causal=True)
        torch.testing.assert_close(together[first : first + n], expected.transpose(0, 1), rtol=1e-4, atol=1e-5)
        first += n


def windowed_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int, softcap: float | None
) -> torch.Tensor:
    """Causal attention of q [n, heads, dim] over keys/values [n, heads, dim] in float64, each
    query seeing the last `window` positions (its own included), scores soft-capped."""
    q, keys, values = (tensor.double().transpose(0, 1) for tensor in (q, keys, values))
    scores = q @ keys.transpose(1, 2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    positions = torch.arange(len(keys[0]))
    seen = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return (weights @ values).transpose(0, 1).float()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.float8_e5m2])
@pytest.mark.parametrize("window, softcap", [(70, None), (5, 2.0), (1000, 3.0), (64, 0.5)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (4, 1, 256), (4, 1, 20)])
def test_a_sliding_window_and_softcapped_scores_keep_the_bits_of_a_decode_step(
    ops, heads, kv_heads, head_dim, window, softcap, kv_dtype
):
    """Gemma's attention: each query sees only its window (tiles before it skipped, the rest
    of its first tile masked), scores soft-capped; a prompt token's bits are its decode
    step's, and both are the float reference's values."""
    prompts = Prompts(torch.Generator().manual_seed(6), [300, 17], heads, kv_heads, head_dim, kv_dtype)
    scale = 0.3 / head_dim**0.5
    options = dict(scale=scale, sliding_window=window, softcap=softcap)
    together = prompts.attend_together(ops, **options)
    prompts.assert_each_token_as_a_decode_step(ops, together, **options)
    k_pool, v_pool, q = prompts.k_pool, prompts.v_pool, prompts.q
    first = 0
    for slots in prompts.request_slots:
        n = len(slots)
        keys = k_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        values = v_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        expected = windowed_reference(q[first : first + n], keys, values, scale, window, softcap)
        torch.testing.assert_close(together[first : first + n], expected, rtol=1e-4, atol=1e-5)
        first += n


PROMPT_TILE_CASES = [
    # heads, kv_heads, head_dim, window, softcap: SmolLM2's and Qwen3's heads, Gemma's 256-wide
    # heads with a window and soft-capped scores, and a head the tiles do not take (20).
    (9, 3, 64, None, None),
    (16, 8, 128, None, None),
    (4, 1, 256, 70, 3.0),
    (8, 2, 64, 5, 2.0),
    (4, 1, 20, None, None),
]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("heads, kv_heads, head_dim, window, softcap", PROMPT_TILE_CASES)
def test_prompt_rows_on_tiles_are_causal_attention_and_keep_their_bits_alone_and_chunked(
    ops, heads, kv_heads, head_dim, window, softcap, kv_dtype
):
    """An AMX-BF16 build attends prompt tokens on bf16 tiles (q, K, V and the softmax weights
    rounded to bf16): near the float reference, each token's bits the same alone, in any
    chunk of its prompt and beside decode steps; those decode steps keep their bits. On other
    builds, and for heads the tiles do not take, the flags change nothing."""
    prompts = Prompts(torch.Generator().manual_seed(8), [300, 40], heads, kv_heads, head_dim, kv_dtype)
    scale = head_dim**-0.5
    options = dict(scale=scale, sliding_window=window, softcap=softcap)
    everything = torch.ones(len(prompts.q), dtype=torch.bool)
    flagged = prompts.attend_together(ops, prompt_rows=everything, **options)
    unflagged = prompts.attend_together(ops, **options)
    first = 0
    for slots in prompts.request_slots:
        n = len(slots)
        keys = prompts.k_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        values = prompts.v_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        expected = windowed_reference(prompts.q[first : first + n], keys, values, scale, window or n, softcap)
        torch.testing.assert_close(flagged[first : first + n], expected, rtol=0.0, atol=0.04)
        first += n
    tiles_ran = ops.isa == "amx_bf16" and head_dim % 32 == 0
    assert torch.equal(flagged, unflagged) != tiles_ran, "the prompt rows took the wrong path"

    def attend(rows: slice, prompt: bool) -> torch.Tensor:
        return ops.decode_attention(
            prompts.q[rows],
            prompts.k_pool,
            prompts.v_pool,
            prompts.padded.view(-1),
            prompts.seq_lens[rows],
            prompts.max_len,
            prompts.slot_rows[rows],
            prompt_rows=torch.full((rows.stop - rows.start,), prompt),
            **options,
        )

    # The first prompt in chunks, as a chunked prefill or a cached prefix splits it.
    for start, stop in [(0, 37), (37, 38), (38, 129), (129, 300)]:
        assert torch.equal(attend(slice(start, stop), True), flagged[start:stop]), f"chunk {start}:{stop}"
    for i in (0, 63, 64, 299, 300, 339):
        assert torch.equal(attend(slice(i, i + 1), True)[0], flagged[i]), f"token {i} alone"
    # Half the tokens as decode steps (not prompt rows) in the same call.
    half = torch.arange(len(prompts.q)) % 2 == 0
    mixed = prompts.attend_together(ops, prompt_rows=half, **options)
    assert torch.equal(mixed[half], flagged[half])
    assert torch.equal(mixed[~half], unflagged[~half])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2])
def test_rope_and_store_matches_the_torch_rotation_and_copy(ops, kv_dtype):
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, tokens = 4, 2, 64, 5
    rotary = RotaryEmbedding(head_dim, 10000.0, None, context_len=64, dtype=torch.float32)
    cos, signed_sin = rotary.lookup(torch.tensor([0, 3, 7, 8, 63]))
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator)
    slots = torch.tensor([9, 2, 5, 1, 7])
    k_pool, v_pool = (torch.zeros(10, kv_heads, head_dim, dtype=kv_dtype) for _ in range(2))

    expected_qk = rotary.rotate(qkv[:, : heads + kv_heads], cos.unsqueeze(1), signed_sin.unsqueeze(1))
    expected_v = qkv[:, heads + kv_heads :].clone()
    ops.rope_and_store(qkv, heads, cos, signed_sin, k_pool, v_pool, slots)

    torch.testing.assert_close(qkv[:, : heads + kv_heads], expected_qk)
    # 16-bit pools round to nearest even, exactly as torch's .to() does.
    assert torch.equal(k_pool[slots], qkv[:, heads : heads + kv_heads].to(kv_dtype))
    assert torch.equal(v_pool[slots], expected_v.to(kv_dtype))
    assert k_pool[0].float().abs().sum() == 0  # untouched slots stay as they were


def _stored_as_e5m2(ops, values: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The bytes rope_and_store writes for `values` as the V rows (one KV head of head_dim,
    as many tokens as it takes) of an fp8 e5m2 pool."""
    tokens = -(-len(values) // head_dim)
    rows = torch.zeros(tokens * head_dim)
    rows[: len(values)] = values
    qkv = torch.zeros(tokens, 3, head_dim)  # one q, one k and one v head a token
    qkv[:, 2] = rows.view(tokens, head_dim)
    k_pool, v_pool = (torch.zeros(tokens + 1, 1, head_dim, dtype=torch.float8_e5m2) for _ in range(2))
    no_rotation = (torch.ones(tokens, head_dim), torch.zeros(tokens, head_dim))  # position 0
    ops.rope_and_store(qkv, 1, *no_rotation, k_pool, v_pool, torch.arange(1, tokens + 1))
    return v_pool[1:].view(torch.uint8).flatten()[: len(values)]


@pytest.mark.parametrize("head_dim", [64, 7, 67], ids=["vector loop", "scalar loop", "both"])
def test_an_fp8_e5m2_pool_rounds_every_value_as_torch_does(ops, head_dim):
    """Every tie (and its neighbours a float32 step away) from below e5m2's subnormals to past
    its largest finite value (57,344: from 61,440 up a value becomes infinity), infinities,
    NaN, both signs: the stored bytes are torch.float8_e5m2's, in the 8-wide store and in its
    scalar tail alike."""
    exponents, mantissas = torch.arange(97, 143), torch.arange(4)  # 2^-30 .. 2^15
    ties = ((exponents[:, None] << 23) | (mantissas[None, :] << 21) | (1 << 20)).flatten().to(torch.int32)
    near_ties = torch.cat([ties - 1, ties, ties + 1]).view(torch.float32)
    large = [57344.0, 61439.0, 61440.0, 65536.0, 1e30, float("inf"), float("nan")]
    generator = torch.Generator().manual_seed(5)
    spread = torch.randn(256, generator=generator) * torch.logspace(-20, 17, 256, base=2.0)
    positive = torch.cat([torch.tensor([0.0, *large]), near_ties, spread])
    values = torch.cat([positive, -positive])
    assert torch.equal(_stored_as_e5m2(ops, values, head_dim), values.to(torch.float8_e5m2).view(torch.uint8))


def test_silu_mul_matches_torch(ops):
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(4)) * 4
    gate, up = gate_up.split(40, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up)


def test_gelu_tanh_mul_matches_torch(ops):
    """Gemma's GeGLU, 43 wide (the vector loop and its scalar tail), gates far into both
    saturated ends."""
    gate_up = torch.randn(17, 2 * 43, generator=torch.Generator().manual_seed(5)) * 6
    gate_up[0, :43] = torch.linspace(-200, 200, 43)
    gate, up = gate_up.split(43, dim=-1)
    torch.testing.assert_close(ops.gelu_tanh_mul(gate_up), F.gelu(gate, approximate="tanh") * up)


# ---------------------------------------------------------------- the contract and the choice of build


def test_every_declared_function_is_bound_with_the_header_types(ops):
    signatures = contract.declared_signatures()
    assert {"sluice_qgemm", "sluice_decode_attention", "sluice_decode_layers", "sluice_self_test"} <= set(signatures)
    restype, argtypes = signatures["sluice_decode_attention"]
    assert restype is not None and len(argtypes) == 18
    assert ops.lib.sluice_decode_attention.argtypes == argtypes
    assert ops.lib.sluice_self_test() == 0


def test_a_library_that_disagrees_with_the_python_side_is_refused(ops, monkeypatch):
    contract.check(ops.lib)
    monkeypatch.setitem(contract.CONSTANTS, "SLUICE_Q4_1", 7)
    with pytest.raises(contract.ContractMismatch, match="SLUICE_Q4_1 is 1 in C, 7 in Python"):
        contract.check(ops.lib)
    monkeypatch.undo()

    fields = dict(contract.ModelDims._fields_)
    swapped = [
        ("hidden", fields["hidden"]),
        ("num_layers", fields["num_layers"]),
        *[(name, kind) for name, kind in contract.ModelDims._fields_ if name not in ("hidden", "num_layers")],
    ]
    SwappedDims = type(
        "SwappedDims", (contract.ctypes.Structure,), {"_c_name_": "sluice_model_dims", "_fields_": swapped}
    )
    monkeypatch.setattr(contract, "STRUCTS", (contract.LayerWeights, SwappedDims))
    with pytest.raises(
        contract.ContractMismatch, match=re.escape("sluice_model_dims.hidden at offset 4 in C, 0 in Python")
    ):
        contract.check(ops.lib)
    monkeypatch.setattr(SwappedDims, "_c_name_", "sluice_no_such_struct")
    with pytest.raises(contract.ContractMismatch, match="does not report"):
        contract.check(ops.lib)


def test_header_parsing_follows_a_changed_declaration():
    header = "/* x */\n#define A 1\nlong sluice_f(const float *x, int n,\n    float eps);\nvoid sluice_g(void);\n"
    signatures = contract.declared_signatures(header)
    assert signatures["sluice_f"][1][1:] == [contract.ctypes.c_int, contract.ctypes.c_float]
    assert signatures["sluice_g"] == (None, [])


@pytest.mark.skipif("avx512_vnni" not in SUPPORTED, reason="needs AVX-512 VNNI, the base of the AMX builds")
@pytest.mark.parametrize("amx_isa", ["amx_int8", "amx_bf16"])
def test_an_amx_build_runs_its_self_test_in_a_child_and_never_kills_the_caller(amx_isa):
    """Where the CPU (or the OS) has no AMX tiles, an AMX build's self-test fails cleanly
    (the kernel refuses the tile permission, or the child dies of an instruction the CPU
    lacks) and the loader passes it over; where it has them, the int8 tiles must give the
    VNNI path's bits and the bf16 tiles their own (the self-test checks both)."""
    from sluice.kernels.build import built_library
    from sluice.kernels.cpu import isa_by_name

    library = str(built_library(isa_by_name(amx_isa)))
    result = subprocess.run(
        [sys.executable, "-c", "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).sluice_self_test())", library],
        capture_output=True,
        check=False,
    )
    if amx_isa not in SUPPORTED:
        # An instruction the CPU lacks (bf16 conversions) may kill the child: the loader
        # treats that as a failed self-test.
        assert result.returncode != 0, "the AMX self-test passed on a CPU without it"
        return
    assert result.returncode >= 0, "the self-test child died by a signal"
    if result.returncode != 0:
        if not _os_grants_tile_data():
            pytest.skip("the CPU has AMX but the kernel refuses this process the tile registers")
        pytest.fail(f"the AMX build failed its self-test (code {result.returncode}) where AMX is granted")


def _os_grants_tile_data() -> bool:
    """Ask Linux for the AMX tile registers (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA) in a child."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).syscall(158, 0x1023, 18) != 0)"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def _chosen_isa(disabled: str) -> str:
    env = {**os.environ, DISABLE_ENV: disabled}
    result = subprocess.run(
        [sys.executable, "-c", "from sluice.kernels.loader import load_kernels; print(load_kernels().describe())"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip() or result.stderr


def test_the_best_instruction_set_is_chosen_and_can_be_switched_off():
    assert _chosen_isa("").startswith(SUPPORTED[0])
    if "avx512_vnni" in SUPPORTED:
        chosen = _chosen_isa("avx512")
        assert chosen.startswith("avx2") and "avx512_vnni disabled" in chosen
    assert "AVX2" in _chosen_isa("avx512,avx2")  # none left: KernelUnavailable says what is needed


@pytest.mark.parametrize("format_name", [format.name for format in BlockFormat])
def test_rows_read_from_the_packed_layout_are_the_dequantized_rows(ops, format_name):
    """An embedding lookup from a tied, quantized table: any rows (the padded last row group
    included) equal the dequantized weight's, bit for bit."""
    quantized, _ = block_weight(BlockFormat[format_name], 37, 96, ops, seed=5)
    ids = torch.tensor([0, 36, 17, 17, 8, 15, 16, 31])
    assert torch.equal(quantized.rows(ids), quantized.dequantize()[ids])
