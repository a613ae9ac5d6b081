"""A GGUF's quantized matrices as the kernels' blocks (gguf_blocks.py): checked against
gguf-py's own dequantization and a float matmul, on random blocks of every type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sluice.kernels.cpu import supported_isas
from sluice.kernels.loader import kernels_available, load_kernels
from sluice.kernels.ops import KernelOps
from sluice.model.block_rows import BlockFormat
from sluice.model.gguf_blocks import block_rows
from sluice.model.quantized_linear import QuantizedLinearWeight, StackedQuantizedWeight, quantized_projection
from tests.gguf_files import random_blocks

ROWS, COLUMNS = 37, 512  # 37: the last row group is partial; 512: two K-quant super-blocks a row

# The types whose blocks the kernels take with every number of the file.
KEPT = {
    "Q8_0": BlockFormat.Q8_0,
    "Q4_1": BlockFormat.Q4_1,
    "Q4_0": BlockFormat.Q4_1,
    "Q5_1": BlockFormat.Q5_1,
    "Q5_0": BlockFormat.Q5_1,
    "Q4_K": BlockFormat.Q4_K,
    "Q5_K": BlockFormat.Q5_K,
    "Q6_K": BlockFormat.Q6_K,
}
ROUNDED_TO_Q8_0 = ["Q2_K", "Q3_K", "IQ4_NL"]


def file_weight(raw: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).copy())


@pytest.mark.parametrize("type_name", list(KEPT))
def test_blocks_the_kernels_share_come_back_exactly(type_name):
    raw = random_blocks(ROWS, COLUMNS, type_name, seed=1)
    rows = block_rows(raw, type_name, (ROWS, COLUMNS), KEPT[type_name])
    assert rows.format is KEPT[type_name] and rows.shape == (ROWS, COLUMNS)
    assert torch.equal(rows.dequantize(), file_weight(raw, type_name))


@pytest.mark.parametrize("isa", [isa.name for isa in supported_isas()])
@pytest.mark.parametrize(("type_name", "row_bytes"), [("Q6_K", 210), ("Q5_K", 180), ("Q4_K", 148)])
def test_super_blocks_keep_every_number_of_the_file_in_the_kernels_layout(isa, type_name, row_bytes):
    """A row's super-block repacked (Q6_K: the file's 210 bytes; Q4_K: 148 for the file's 144,
    its 6-bit scales and minimums unpacked to bytes; Q5_K: 180 for 176 likewise): the packed
    weight and any rows looked up in it (a tied embedding table) are the file's weights exactly."""
    raw = random_blocks(ROWS, COLUMNS, type_name, seed=8)
    weight = QuantizedLinearWeight.from_rows(
        block_rows(raw, type_name, (ROWS, COLUMNS), KEPT[type_name]), KernelOps(load_kernels(isa))
    )
    row_groups = -(-ROWS // weight.ops.row_group)
    assert weight.packed.numel() == row_groups * weight.ops.row_group * (COLUMNS // 256) * row_bytes
    expected = file_weight(raw, type_name)
    assert torch.equal(weight.dequantize(), expected)
    ids = torch.tensor([36, 0, 17, 17, 15, 16])
    assert torch.equal(weight.rows(ids), expected[ids])


@pytest.mark.parametrize("isa", [isa.name for isa in supported_isas()])
@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1"])
def test_q5_blocks_keep_every_number_of_the_file_in_24_bytes_a_row_and_block(isa, type_name):
    """Q5_1's blocks (Q5_0's with m = -16 d) packed as q5_1: 24 bytes a row and block (the
    file's 24, or 22 for Q5_0), their fifth bits where the kernel reads them: the packed weight
    and rows looked up in it are the file's weights exactly."""
    raw = random_blocks(ROWS, COLUMNS, type_name, seed=9)
    weight = QuantizedLinearWeight.from_rows(
        block_rows(raw, type_name, (ROWS, COLUMNS), BlockFormat.Q5_1), KernelOps(load_kernels(isa))
    )
    row_groups = -(-ROWS // weight.ops.row_group)
    assert weight.packed.numel() == row_groups * weight.ops.row_group * (COLUMNS // 32) * 24
    expected = file_weight(raw, type_name)
    assert torch.equal(weight.dequantize(), expected)
    ids = torch.tensor([36, 0, 17, 17, 15, 16])
    assert torch.equal(weight.rows(ids), expected[ids])


def test_q4_k_as_q4_1_keeps_the_files_quants_and_rounds_only_block_scales():
    """--quantization auto on AVX-512 and AMX: Q4_K runs as q4_1 blocks holding the file's quants."""
    raw = random_blocks(ROWS, COLUMNS, "Q4_K", seed=2)
    rows = block_rows(raw, "Q4_K", (ROWS, COLUMNS), BlockFormat.Q4_1)
    expected = file_weight(raw, "Q4_K")
    assert rows.format is BlockFormat.Q4_1
    # Each 32-weight block: w = d' q + m' with the file's q; d' and m' are within float16's
    # rounding (2^-11 relative) of the file's d * sc and -dmin * mn.
    blocks = expected.reshape(ROWS, -1, 32)
    d, m = (scale.float() for scale in rows.scales)
    bound = 2**-11 * (15 * d.abs() + m.abs()) + 1e-7
    assert ((rows.dequantize().reshape(ROWS, -1, 32) - blocks).abs() <= bound.unsqueeze(-1)).all()
    # Rounding them again to q4_1 from floats would not give these quants back (the file's
    # blocks rarely span 0..15 exactly); the direct read keeps them.
    nibbles = torch.cat((rows.quants & 0x0F, rows.quants >> 4), dim=-1).float()
    recovered = torch.round((blocks - m.unsqueeze(-1)) / d.unsqueeze(-1))
    scaled = d != 0  # a block whose 6-bit scale is 0 holds only its minimum
    assert scaled.float().mean() > 0.9
    assert torch.equal(nibbles[scaled], recovered[scaled])


@pytest.mark.parametrize("type_name", ROUNDED_TO_Q8_0)
def test_other_types_are_rounded_to_q8_0(type_name):
    raw = random_blocks(ROWS, COLUMNS, type_name, seed=3)
    rows = block_rows(raw, type_name, (ROWS, COLUMNS), BlockFormat.Q8_0)
    expected = file_weight(raw, type_name)
    block_max = expected.reshape(ROWS, -1, 32).abs().amax(-1, keepdim=True)
    error = (rows.dequantize() - expected).reshape(ROWS, -1, 32).abs()
    assert (error <= block_max / 254 * 1.01 + 1e-8).all()  # half a step of 127 (float16 scale aside)


def test_rows_take_permute_split_and_stack():
    raw = random_blocks(ROWS, COLUMNS, "Q4_K", seed=4)
    rows = block_rows(raw, "Q4_K", (ROWS, COLUMNS), BlockFormat.Q4_K)
    dense = rows.dequantize()
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0))
    assert torch.equal(rows.take_rows(order).dequantize(), dense[order])
    top, bottom = rows.split([10, ROWS - 10])
    assert torch.equal(top.dequantize(), dense[:10]) and torch.equal(bottom.dequantize(), dense[10:])
    other = block_rows(random_blocks(5, COLUMNS, "Q8_0", seed=5), "Q8_0", (5, COLUMNS), BlockFormat.Q8_0)
    mixed = type(rows).stack([rows, other])
    # Mixed formats stack in the most precise one; the q8_0 part is unchanged.
    assert mixed.format is BlockFormat.Q8_0 and mixed.shape == (ROWS + 5, COLUMNS)
    assert torch.equal(mixed.dequantize()[ROWS:], other.dequantize())
    assert (mixed.dequantize()[:ROWS] - dense).abs().max() <= dense.abs().max() / 127


@pytest.mark.parametrize("isa", [isa.name for isa in supported_isas()])
@pytest.mark.parametrize("type_name", [*KEPT, *ROUNDED_TO_Q8_0])
def test_the_kernel_multiplies_what_the_file_holds(isa, type_name):
    raw = random_blocks(ROWS, COLUMNS, type_name, seed=6)
    format = KEPT.get(type_name, BlockFormat.Q8_0)
    weight = QuantizedLinearWeight.from_rows(
        block_rows(raw, type_name, (ROWS, COLUMNS), format), KernelOps(load_kernels(isa))
    )
    x = torch.randn(9, COLUMNS, generator=torch.Generator().manual_seed(7))
    expected = F.linear(x, file_weight(raw, type_name))
    # x's rounding to int8 blocks (1/127 of a block's max), and q8_0's for the other types.
    assert ((weight.matmul(x) - expected).abs().max() / expected.abs().max()).item() < 2e-2


@pytest.mark.parametrize("isa", [isa.name for isa in supported_isas()])
def test_a_projection_stacked_from_two_types_keeps_each_in_its_own_blocks(isa):
    """A Q4_K_M file's q and k (Q4_K) fused with its v (Q6_K): q and k stay q4_k above a q6_k
    tail, and each part's columns of the product are the bits of that part alone."""
    ops = KernelOps(load_kernels(isa))
    types = {"q": ("Q4_K", 48), "k": ("Q4_K", 16), "v": ("Q6_K", 21)}  # v: a partial row group
    raws = {
        name: random_blocks(rows, COLUMNS, type_name, seed=len(name) + rows)
        for name, (type_name, rows) in types.items()
    }
    parts = [
        block_rows(raws[name], type_name, (rows, COLUMNS), KEPT[type_name]) for name, (type_name, rows) in types.items()
    ]
    weight = quantized_projection(parts, ops)
    assert isinstance(weight, StackedQuantizedWeight)
    assert [part.format for part in weight.parts] == [BlockFormat.Q4_K, BlockFormat.Q6_K]
    assert (weight.head.out_features, weight.tail.out_features, weight.out_features) == (64, 21, 85)
    dense = torch.cat([file_weight(raws[name], type_name) for name, (type_name, _) in types.items()])
    assert torch.equal(weight.dequantize(), dense)

    x = torch.randn(5, COLUMNS, generator=torch.Generator().manual_seed(3))
    out = weight.matmul(x)
    assert torch.equal(out, torch.cat([weight.head.matmul(x), weight.tail.matmul(x)], dim=1))
    expected = F.linear(x, dense)
    assert ((out - expected).abs().max() / expected.abs().max()).item() < 2e-2


@pytest.mark.skipif(not kernels_available(), reason="the C kernels need an x86-64 CPU with AVX2 and gcc")
def test_parts_of_one_type_stack_as_one_weight_and_three_types_round_the_head():
    ops = KernelOps(load_kernels())
    rows = {t: block_rows(random_blocks(16, COLUMNS, t, seed=9), t, (16, COLUMNS), KEPT[t]) for t in KEPT}
    same = quantized_projection([rows["Q4_K"], rows["Q4_K"]], ops)
    assert isinstance(same, QuantizedLinearWeight) and same.format is BlockFormat.Q4_K and same.out_features == 32
    # The trailing run of one type is the tail; the rest stack in the most precise of theirs.
    three = quantized_projection([rows["Q4_K"], rows["Q5_K"], rows["Q6_K"], rows["Q6_K"]], ops)
    assert isinstance(three, StackedQuantizedWeight)
    assert (three.head.format, three.head.out_features) == (BlockFormat.Q8_0, 32)
    assert (three.tail.format, three.tail.out_features) == (BlockFormat.Q6_K, 32)


@pytest.mark.skipif(not kernels_available(), reason="the C kernels need an x86-64 CPU with AVX2 and gcc")
def test_qgemm_writes_into_some_columns_of_a_wider_output():
    ops = KernelOps(load_kernels())
    weight = QuantizedLinearWeight.from_rows(
        block_rows(random_blocks(ROWS, COLUMNS, "Q4_K", seed=2), "Q4_K", (ROWS, COLUMNS), BlockFormat.Q4_K), ops
    )
    x = torch.randn(3, COLUMNS, generator=torch.Generator().manual_seed(1))
    wide = torch.full((3, ROWS + 10), 7.0)
    ops.qgemm(x, weight.format, weight.packed, ROWS, out=wide[:, 4 : 4 + ROWS])
    assert torch.equal(wide[:, 4 : 4 + ROWS], weight.matmul(x))
    assert (wide[:, :4] == 7).all() and (wide[:, 4 + ROWS :] == 7).all()  # the other columns untouched
    with pytest.raises(ValueError, match="contiguous rows"):
        ops.qgemm(x, weight.format, weight.packed, ROWS, out=wide[:, 4 : 4 + ROWS].t().contiguous().t())
