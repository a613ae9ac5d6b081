"""Linear weights kept in 32-weight blocks (q8_0, q5_1, q4_1, and GGUF's q6_k, q5_k and q4_k
super-blocks of eight of them) and multiplied by the C kernel.

A decode step reads every weight once, so its speed is set by bytes per weight: 1.06 for
q8_0, 0.82 for q6_k, 0.75 for q5_1, 0.70 for q5_k, 0.625 for q4_1 and 0.58 for q4_k against
4 for float32. A prompt is
bound by arithmetic instead, where the kernel's integer dot products (32 multiply-adds in
two instructions) still run 1.5x (q8_0, q6_k) to 2.4x (q4_1, q4_k) MKL's float32 matmul on an
AVX2 Zen 3, 128 rows on two threads. So every token of a quantized model goes
through the kernel, and the model keeps no dense copy of a quantized weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice.kernels.contract import BLOCK, SUPER_BLOCK, BlockFormat
from sluice.kernels.ops import KernelOps
from sluice.model.block_rows import BLOCK_QUANT_BYTES, SUPER_BLOCK_SCALES, SUPER_QUANT_BYTES, BlockRows

__all__ = ["QuantizedLinearWeight", "QuantizedProjection", "StackedQuantizedWeight", "quantized_projection"]


@dataclass(slots=True)
class QuantizedLinearWeight:
    """A [out, in] weight as blocks of 32, interleaved by row groups for one build of the kernels.

    The layout (see qgemm.c): rows go in groups of `ops.row_group` (8 for AVX2, 16 for
    AVX-512; the last group padded with zero rows); a group's blocks follow each other, and
    each holds the group's quants, 4 weights of a row next to 4 of the next, then their
    float16 scales (and q4_1's float16 minimums).
    """

    format: BlockFormat
    out_features: int
    in_features: int
    packed: torch.Tensor  # uint8 [row_groups * blocks_per_row * group block bytes]
    ops: KernelOps = field(repr=False)  # the build whose layout `packed` is in

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: BlockFormat, ops: KernelOps) -> QuantizedLinearWeight:
        return cls.from_rows(BlockRows.quantize(weight, format), ops)

    @classmethod
    def from_rows(cls, rows: BlockRows, ops: KernelOps) -> QuantizedLinearWeight:
        out_features, in_features = rows.shape
        if rows.format in SUPER_BLOCK_SCALES:
            packed = _interleave_super_blocks(rows, ops.row_group)
        else:
            packed = _interleave(rows.quants, rows.scales, ops.row_group)
        return cls(rows.format, out_features, in_features, packed, ops)

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight these blocks stand for."""
        if self.format in SUPER_BLOCK_SCALES:
            return self.rows(torch.arange(self.out_features))
        quant_bytes = BLOCK_QUANT_BYTES[self.format]
        num_scales = 1 if self.format is BlockFormat.Q8_0 else 2
        quants, scales = _deinterleave(
            self.packed, self.out_features, self.in_features // BLOCK, quant_bytes, num_scales, self.ops.row_group
        )
        return BlockRows(self.format, quants, scales).dequantize()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: rows `ids` of the weight these blocks stand for, read from
        the packed layout (an embedding lookup from a quantized table)."""
        group = self.ops.row_group
        groups = -(-self.out_features // group)
        picked_group, within = ids // group, ids % group
        if self.format in SUPER_BLOCK_SCALES:
            by_group = self.packed.view(groups, self.in_features // SUPER_BLOCK, -1)
            return _super_block_rows(self.format, by_group, picked_group, within, group).dequantize()
        quant_bytes = BLOCK_QUANT_BYTES[self.format]
        blocks = self.in_features // BLOCK
        # Only the picked rows' bytes are gathered (not their whole row groups): a view that
        # splits each block's bytes by row, indexed by (row group, row).
        by_group = self.packed.view(groups, blocks, -1)
        quants = by_group[..., : group * quant_bytes].unflatten(-1, (quant_bytes // 4, group, 4))
        quants = quants[picked_group, :, :, within].reshape(len(ids), blocks, quant_bytes)
        scales = [
            by_group[..., start : start + 2 * group]
            .unflatten(-1, (group, 2))[picked_group, :, within]
            .contiguous()
            .view(torch.float16)
            .squeeze(-1)
            for start in range(group * quant_bytes, by_group.shape[-1], 2 * group)
        ]
        return BlockRows(self.format, quants, scales).dequantize()

    @property
    def parts(self) -> list[QuantizedLinearWeight]:
        return [self]

    def matmul(self, x: torch.Tensor, prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ weight.T -> float32 [rows, out]; x is quantized to int8 blocks on the way
        (prompt_rows: see KernelOps.qgemm)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {self.in_features}")
        return self.ops.qgemm(x, self.format, self.packed, self.out_features, prompt_rows=prompt_rows)


@dataclass(slots=True)
class StackedQuantizedWeight:
    """A fused projection whose sources came in two block formats (a Q4_K_M file's q and k in
    q4_k above its v in q6_k), each part kept in its own: `head`'s output rows, then `tail`'s.
    Stacked in one format, the head would be rounded to q8_0 and read at 1.06 bytes a weight
    instead of the file's 0.58."""

    head: QuantizedLinearWeight
    tail: QuantizedLinearWeight

    @property
    def parts(self) -> list[QuantizedLinearWeight]:
        return [self.head, self.tail]

    @property
    def out_features(self) -> int:
        return self.head.out_features + self.tail.out_features

    @property
    def in_features(self) -> int:
        return self.head.in_features

    def dequantize(self) -> torch.Tensor:
        return torch.cat([self.head.dequantize(), self.tail.dequantize()])

    def matmul(self, x: torch.Tensor, prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ weight.T -> float32 [rows, out]: each part into its own columns."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {self.in_features}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features)
        start = 0
        for part in self.parts:
            end = start + part.out_features
            columns = out[:, start:end]
            part.ops.qgemm(x, part.format, part.packed, part.out_features, out=columns, prompt_rows=prompt_rows)
            start = end
        return out


# A projection's weight as the kernels multiply it.
QuantizedProjection = QuantizedLinearWeight | StackedQuantizedWeight


def quantized_projection(parts: list[BlockRows], ops: KernelOps) -> QuantizedProjection:
    """One projection from `parts` stacked in order: one weight in their format if they share
    one, else the trailing run of one format apart from the rest (stacked as BlockRows.stack
    does)."""
    formats = [part.format for part in parts]
    split = len(parts)
    while split > 0 and formats[split - 1] is formats[-1]:
        split -= 1
    if split == 0:
        return QuantizedLinearWeight.from_rows(BlockRows.stack(parts), ops)
    head, tail = (QuantizedLinearWeight.from_rows(BlockRows.stack(run), ops) for run in (parts[:split], parts[split:]))
    return StackedQuantizedWeight(head, tail)


def _interleave(quants: torch.Tensor, scales: list[torch.Tensor], row_group: int) -> torch.Tensor:
    """uint8 [rows, blocks, quant_bytes] and float16 [rows, blocks] scales -> qgemm.c's layout. Each
    part is copied once, into its place."""
    rows, blocks, quant_bytes = quants.shape
    padding = -rows % row_group
    groups = (rows + padding) // row_group
    packed = torch.empty(groups, blocks, row_group * (quant_bytes + 2 * len(scales)), dtype=torch.uint8)
    words = _padded_rows(quants, padding).view(torch.int32)  # moved a 4-byte word at a time
    # [group, row, block, word] -> [group, block, word, row]: 4 bytes of each row in turn.
    end = row_group * quant_bytes
    packed.view(torch.int32)[..., : end // 4].unflatten(-1, (quant_bytes // 4, row_group)).copy_(
        words.view(groups, row_group, blocks, quant_bytes // 4).permute(0, 2, 3, 1)
    )
    for scale in scales:
        start, end = end, end + 2 * row_group
        packed[..., start:end].view(torch.float16).copy_(
            _padded_rows(scale, padding).view(groups, row_group, blocks).transpose(1, 2)
        )
    return packed.view(-1)


def _interleave_super_blocks(rows: BlockRows, row_group: int) -> torch.Tensor:
    """Super-block BlockRows (q6_k, q5_k, q4_k) -> qgemm.c's layout: per row group and super-block, eight blocks of
    a row's quant bytes in 4-byte words, row after row, then each scale part [count][row]. Each part is
    copied once, into its place."""
    count, blocks, quant_bytes = rows.quants.shape
    padding = -count % row_group
    groups, supers = (count + padding) // row_group, blocks // 8
    scale_bytes = [part.shape[-1] * part.dtype.itemsize for part in rows.scales]  # a row's, per super-block
    packed = torch.empty(groups, supers, row_group * (8 * quant_bytes + sum(scale_bytes)), dtype=torch.uint8)
    words = _padded_rows(rows.quants, padding).view(torch.int32)  # moved a 4-byte word at a time
    # [group, row, super, block, word] -> [group, super, block, word, row]
    end = row_group * 8 * quant_bytes
    packed.view(torch.int32)[..., : end // 4].unflatten(-1, (8, quant_bytes // 4, row_group)).copy_(
        words.view(groups, row_group, supers, 8, quant_bytes // 4).permute(0, 2, 3, 4, 1)
    )
    for scale, size in zip(rows.scales, scale_bytes, strict=True):
        # [group, row, super, count, byte] -> [group, super, count, row, byte]: a row group's values side by side
        as_bytes = _padded_rows(scale, padding).view(torch.uint8).view(groups, row_group, supers, scale.shape[-1], -1)
        start, end = end, end + row_group * size
        packed[..., start:end].unflatten(-1, (scale.shape[-1], row_group, scale.dtype.itemsize)).copy_(
            as_bytes.permute(0, 2, 3, 1, 4)
        )
    return packed.view(-1)


def _padded_rows(part: torch.Tensor, padding: int) -> torch.Tensor:
    """`part` [rows, ...] with `padding` rows of zeros after its own (itself when none)."""
    if not padding:
        return part.contiguous()
    return torch.cat((part, part.new_zeros(padding, *part.shape[1:])))


def _super_block_rows(
    format: BlockFormat, by_group: torch.Tensor, picked_group: torch.Tensor, within: torch.Tensor, row_group: int
) -> BlockRows:
    """Row `within[i]` of row group `picked_group[i]` as BlockRows, from uint8 `by_group`
    [row groups, super-blocks, a row group's super-block bytes]: the inverse of
    _interleave_super_blocks, gathering only those rows' bytes."""
    supers = by_group.shape[1]
    quant_bytes = SUPER_QUANT_BYTES[format]
    offset = 8 * quant_bytes * row_group
    quants = by_group[..., :offset].unflatten(-1, (8, quant_bytes // 4, row_group, 4))
    quants = quants[picked_group, :, :, :, within].reshape(len(picked_group), supers * 8, quant_bytes)
    scales = []
    for count, dtype in SUPER_BLOCK_SCALES[format]:
        size = count * row_group * dtype.itemsize
        part = by_group[..., offset : offset + size].unflatten(-1, (count, row_group, dtype.itemsize))
        scales.append(part[picked_group, :, :, within].contiguous().view(dtype).squeeze(-1))  # [n, supers, count]
        offset += size
    return BlockRows(format, quants, scales)


def _deinterleave(
    packed: torch.Tensor, rows: int, blocks: int, quant_bytes: int, num_scales: int, row_group: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The inverse of _interleave: (uint8 [rows, blocks, quant_bytes], float16 [rows, blocks] scales)."""
    groups = -(-rows // row_group)
    parts = packed.view(groups, blocks, -1).split([row_group * quant_bytes] + [2 * row_group] * num_scales, dim=-1)
    quants = (
        parts[0]
        .reshape(groups, blocks, quant_bytes // 4, row_group, 4)
        .permute(0, 3, 1, 2, 4)
        .reshape(groups * row_group, blocks, quant_bytes)[:rows]
    )
    scales = [
        part.contiguous().view(torch.float16).transpose(1, 2).reshape(groups * row_group, blocks)[:rows]
        for part in parts[1:]
    ]
    return quants, scales
