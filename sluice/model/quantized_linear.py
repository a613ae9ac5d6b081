"""Linear weights kept in 32-weight blocks (q8_0, q5_1, q4_1, and GGUF's q6_k, q5_k and q4_k
super-blocks of eight of them) and multiplied by the C kernel.

A decode step reads every weight once, so its speed is set by bytes per weight: 1.06 for
q8_0, 0.82 for q6_k, 0.75 for q5_1, 0.70 for q5_k, 0.625 for q4_1 and 0.58 for q4_k against
4 for float32. A prompt is
bound by arithmetic instead, where the kernel's integer dot products (32 multiply-adds in
two instructions) still run about 1.5x MKL's float32 matmul on an AVX2 CPU. So every token of a quantized model goes
through the kernel, and the model keeps no dense copy of a quantized weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice.kernels.contract import BLOCK, SUPER_BLOCK, BlockFormat
from sluice.kernels.ops import KernelOps

__all__ = [
    "BLOCK",
    "BlockFormat",
    "BlockRows",
    "QuantizedLinearWeight",
    "QuantizedProjection",
    "StackedQuantizedWeight",
    "fused_format",
    "pack_nibbles",
]


def fused_format(formats: list[BlockFormat | None]) -> BlockFormat | None:
    """The format for weights stacked into one matrix: theirs when they share one, else q8_0
    (which holds any of them within its rounding); None if any stays dense."""
    if any(format is None for format in formats):
        return None
    return formats[0] if len(set(formats)) == 1 else BlockFormat.Q8_0


@dataclass(slots=True)
class BlockRows:
    """A [out, in] weight as rows of 32-weight blocks in one format, in plain row order: what
    a file's blocks or a float weight become before the kernel's interleaving.

    q8_0: a block is 32 int8 quants and a float16 scale d (w = d * q). q4_1: 16 bytes, byte
    j holding weight j in its low nibble and weight j + 16 in its high one (GGUF's order),
    a float16 scale d and minimum m (w = d * q + m). q5_1: as q4_1 with 5-bit quants, the
    bytes as q5_k's (see pack_five_bits). The super-block formats come only from a
    GGUF's blocks of the same name, their numbers kept: q6_k, 6-bit quants as q4_1's 16 bytes
    of low nibbles and 8 of high bits (see pack_six_bits), an int8 scale per 16 weights and a
    float16 d per 256 (w = d * sc * (q - 32)); q4_k, q4_1's nibbles, a 6-bit scale and minimum
    per 32 (as uint8) and a float16 d and dmin per 256 (w = d * sc * q - dmin * mn); q5_k, as
    q4_k with 5-bit quants, the nibbles followed by 4 bytes of fifth bits (see pack_five_bits).
    """

    format: BlockFormat
    quants: torch.Tensor  # uint8 [rows, blocks, quant bytes]
    # q8_0, q4_1, q5_1: float16 [rows, blocks]: d, and q4_1's and q5_1's m. The super-block formats: each of
    # SUPER_BLOCK_SCALES[format] as [rows, super-blocks, count] in its dtype.
    scales: list[torch.Tensor]

    @property
    def shape(self) -> tuple[int, int]:
        return self.quants.shape[0], self.quants.shape[1] * BLOCK

    def __len__(self) -> int:
        return self.quants.shape[0]

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: BlockFormat) -> BlockRows:
        """Round a float [out, in] weight to blocks of `format`."""
        out_features, in_features = weight.shape
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
        blocks = weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)
        if format in SUPER_BLOCK_SCALES:
            raise ValueError(f"{format.name.lower()} blocks come from a GGUF file, they are not rounded from floats")
        if format is BlockFormat.Q8_0:
            d = (blocks.abs().amax(dim=-1) / 127).half()
            q = torch.round(blocks / _nonzero(d).unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
            return cls(format, q.view(torch.uint8), [d])
        top = 31 if format is BlockFormat.Q5_1 else 15
        low, high = blocks.amin(dim=-1).half(), blocks.amax(dim=-1)
        d = ((high - low.float()) / top).half()
        q = torch.round((blocks - low.float().unsqueeze(-1)) / _nonzero(d).unsqueeze(-1)).clamp_(0, top).to(torch.uint8)
        return cls(format, pack_five_bits(q) if format is BlockFormat.Q5_1 else pack_nibbles(q), [d, low])

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight these blocks stand for."""
        if self.format is BlockFormat.Q8_0:
            values = self.quants.view(torch.int8).float() * self.scales[0].float().unsqueeze(-1)
        elif self.format is BlockFormat.Q6_K:
            rows = self.quants.shape[0]
            sub_scales, d = self.scales
            q = unpack_six_bits(self.quants).float() - 32  # [rows, blocks, 32]
            scale = d.float() * sub_scales.float()  # [rows, super-blocks, 16]
            values = q.reshape(rows, -1, 16) * scale.reshape(rows, -1, 1)
        elif self.format in (BlockFormat.Q4_K, BlockFormat.Q5_K):
            rows = self.quants.shape[0]
            sc, mn, d, dmin = (part.float().reshape(rows, -1) for part in self.scales)  # per block or super-block
            q = unpack_five_bits(self.quants) if self.format is BlockFormat.Q5_K else unpack_nibbles(self.quants)
            q = q.float()  # [rows, blocks, 32]
            scale, minimum = (d.repeat_interleave(8, dim=1) * sc), (dmin.repeat_interleave(8, dim=1) * mn)
            values = q * scale.unsqueeze(-1) - minimum.unsqueeze(-1)
        else:
            q = (
                unpack_five_bits(self.quants) if self.format is BlockFormat.Q5_1 else unpack_nibbles(self.quants)
            ).float()
            d, m = (scale.float().unsqueeze(-1) for scale in self.scales)
            values = q * d + m
        return values.reshape(self.shape)

    def to_format(self, format: BlockFormat) -> BlockRows:
        return self if format is self.format else BlockRows.quantize(self.dequantize(), format)

    def take_rows(self, index: torch.Tensor) -> BlockRows:
        return BlockRows(self.format, self.quants[index], [scale[index] for scale in self.scales])

    def split(self, sizes: list[int]) -> list[BlockRows]:
        quants = self.quants.split(sizes)
        scales = [scale.split(sizes) for scale in self.scales]
        return [BlockRows(self.format, q, [s[i] for s in scales]) for i, q in enumerate(quants)]

    @staticmethod
    def stack(parts: list[BlockRows]) -> BlockRows:
        """The parts one above the other, in the most precise of their formats."""
        format = fused_format([part.format for part in parts])
        assert format is not None
        parts = [part.to_format(format) for part in parts]
        if len(parts) == 1:
            return parts[0]
        scales = [torch.cat([part.scales[i] for part in parts]) for i in range(len(parts[0].scales))]
        return BlockRows(format, torch.cat([part.quants for part in parts]), scales)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 32] values in [0, 16) -> [..., 16] bytes in GGUF's order (weight j low, j + 16 high)."""
    return q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)


def unpack_nibbles(quants: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [..., 16] -> [..., 32] values in [0, 16)."""
    return torch.cat((quants & 0x0F, quants >> 4), dim=-1)


# The super-block formats' scales after their quants, in qgemm.c's order: (count per row and
# super-block, dtype) each.
SUPER_BLOCK_SCALES: dict[BlockFormat, list[tuple[int, torch.dtype]]] = {
    BlockFormat.Q6_K: [(16, torch.int8), (1, torch.float16)],  # sub-block scales, d
    BlockFormat.Q4_K: [(8, torch.uint8), (8, torch.uint8), (1, torch.float16), (1, torch.float16)],  # sc, mn, d, dmin
    BlockFormat.Q5_K: [(8, torch.uint8), (8, torch.uint8), (1, torch.float16), (1, torch.float16)],  # as Q4_K
}
# The 32-weight formats' bytes of quants a row and block.
_BLOCK_QUANT_BYTES = {BlockFormat.Q8_0: BLOCK, BlockFormat.Q4_1: BLOCK // 2, BlockFormat.Q5_1: BLOCK // 2 + 4}
_SUPER_QUANT_BYTES = {BlockFormat.Q6_K: 24, BlockFormat.Q4_K: 16, BlockFormat.Q5_K: 20}  # a row's per 32 weights

# Four 2-bit fields of a byte, at bits 0, 2, 4, 6: how Q6_K keeps its high bits, in the file
# and in qgemm.c's words (there, field g of a half belongs to word g).
HIGH_BIT_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)


def pack_six_bits(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 32] values in [0, 64) -> [..., 24] bytes: the low nibbles as pack_nibbles,
    then 8 bytes of the high two bits, byte 4h + t holding those of weight 16h + 4g + t at
    bits 2g..2g+1 (qgemm.c's q6_k words)."""
    high = (q >> 4).reshape(*q.shape[:-1], 2, 4, 4) << HIGH_BIT_SHIFTS  # [..., half, g, t]
    packed_high = high[..., 0, :] | high[..., 1, :] | high[..., 2, :] | high[..., 3, :]
    return torch.cat((pack_nibbles(q & 0x0F), packed_high.reshape(*q.shape[:-1], 8)), dim=-1)


# Bit g of a q5_k fifth-bit byte t belongs to weight 4g + t (qgemm.c's q5_k words).
_FIFTH_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8).view(8, 1)


def pack_five_bits(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 32] values in [0, 32) -> [..., 20] bytes: the low nibbles as pack_nibbles,
    then 4 bytes of fifth bits, byte t holding that of weight 4g + t at bit g."""
    fifth = ((q >> 4).reshape(*q.shape[:-1], 8, 4) << _FIFTH_BIT_SHIFTS).sum(dim=-2, dtype=torch.uint8)
    return torch.cat((pack_nibbles(q & 0x0F), fifth), dim=-1)


def unpack_five_bits(quants: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_five_bits: uint8 [..., 20] -> [..., 32] values in [0, 32)."""
    fifth = (quants[..., 16:].unsqueeze(-2) >> _FIFTH_BIT_SHIFTS) & 1  # [..., g, t]
    return unpack_nibbles(quants[..., :16]) | (fifth.reshape(*quants.shape[:-1], BLOCK) << 4)


def unpack_six_bits(quants: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_six_bits: uint8 [..., 24] -> [..., 32] values in [0, 64)."""
    low = unpack_nibbles(quants[..., :16])
    high = (quants[..., 16:].reshape(*quants.shape[:-1], 2, 1, 4) >> HIGH_BIT_SHIFTS) & 3  # [..., half, g, t]
    return low | (high.reshape(*quants.shape[:-1], BLOCK) << 4)


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
        quant_bytes = _BLOCK_QUANT_BYTES[self.format]
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
        within, every = ids % group, torch.arange(len(ids))
        if self.format in SUPER_BLOCK_SCALES:
            supers = self.in_features // SUPER_BLOCK
            picked_supers = self.packed.view(groups, supers, -1)[ids // group]
            return _super_block_rows(self.format, picked_supers, within, group).dequantize()
        quant_bytes = _BLOCK_QUANT_BYTES[self.format]
        blocks = self.in_features // BLOCK
        picked = self.packed.view(groups, blocks, -1)[ids // group]  # [n, blocks, a row group's block bytes]
        n = len(ids)
        quants = picked[..., : group * quant_bytes].reshape(n, blocks, quant_bytes // 4, group, 4)
        quants = quants.permute(0, 3, 1, 2, 4)[every, within].reshape(n, blocks, quant_bytes)
        scales = [
            picked[..., start : start + 2 * group].contiguous().view(torch.float16).transpose(1, 2)[every, within]
            for start in range(group * quant_bytes, picked.shape[-1], 2 * group)
        ]
        return BlockRows(self.format, quants, scales).dequantize()

    @property
    def parts(self) -> list[QuantizedLinearWeight]:
        return [self]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ weight.T -> float32 [rows, out]; x is quantized to int8 blocks on the way."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {self.in_features}")
        return self.ops.qgemm(x, self.format, self.packed, self.out_features)


@dataclass(slots=True)
class StackedQuantizedWeight:
    """A fused projection whose sources came in two block formats (a Q4_K_M file's q and k in
    q4_k above its v in q6_k), each part kept in its own: `head`'s output rows, then `tail`'s.
    Stacked in one format, the head would be rounded to q8_0 and read at 1.06 bytes a weight
    instead of the file's 0.58."""

    head: QuantizedLinearWeight
    tail: QuantizedLinearWeight

    @classmethod
    def from_rows(cls, parts: list[BlockRows], ops: KernelOps) -> QuantizedProjection:
        """One weight from `parts` stacked in order: in their format if they share one, else
        the trailing run of one format apart from the rest (stacked as BlockRows.stack does)."""
        formats = [part.format for part in parts]
        split = len(parts)
        while split > 0 and formats[split - 1] is formats[-1]:
            split -= 1
        if split == 0:
            return QuantizedLinearWeight.from_rows(BlockRows.stack(parts), ops)
        head, tail = (BlockRows.stack(run) for run in (parts[:split], parts[split:]))
        return cls(QuantizedLinearWeight.from_rows(head, ops), QuantizedLinearWeight.from_rows(tail, ops))

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

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ weight.T -> float32 [rows, out]: each part into its own columns."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {self.in_features}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features)
        start = 0
        for part in self.parts:
            end = start + part.out_features
            part.ops.qgemm(x, part.format, part.packed, part.out_features, out=out[:, start:end])
            start = end
        return out


# A projection's weight as the kernels multiply it.
QuantizedProjection = QuantizedLinearWeight | StackedQuantizedWeight


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """float32 of the float16 scales, with 0 (an all-equal block) replaced by 1 to divide by."""
    d = d.float()
    return torch.where(d == 0, 1.0, d)


def _interleave(quants: torch.Tensor, scales: list[torch.Tensor], row_group: int) -> torch.Tensor:
    """uint8 [rows, blocks, quant_bytes] and float16 [rows, blocks] scales -> qgemm.c's layout."""
    rows, blocks, quant_bytes = quants.shape
    padding = -rows % row_group
    groups = (rows + padding) // row_group
    quants = torch.nn.functional.pad(quants, (0, 0, 0, 0, 0, padding))
    # [group, row, block, word, byte] -> [group, block, word, row, byte]: 4 bytes of each row in turn.
    parts = [
        quants.view(groups, row_group, blocks, quant_bytes // 4, 4)
        .permute(0, 2, 3, 1, 4)
        .reshape(groups, blocks, row_group * quant_bytes)
    ]
    for scale in scales:
        padded = torch.nn.functional.pad(scale, (0, 0, 0, padding))
        parts.append(
            padded.view(groups, row_group, blocks)
            .transpose(1, 2)
            .contiguous()
            .view(torch.uint8)
            .view(groups, blocks, 2 * row_group)
        )
    return torch.cat(parts, dim=-1).reshape(-1).contiguous()


def _interleave_super_blocks(rows: BlockRows, row_group: int) -> torch.Tensor:
    """Super-block BlockRows (q6_k, q5_k, q4_k) -> qgemm.c's layout: per row group and super-block, eight blocks of
    a row's quant bytes in 4-byte words, row after row, then each scale part [count][row]."""
    count, blocks, quant_bytes = rows.quants.shape
    padding = -count % row_group
    groups, supers = (count + padding) // row_group, blocks // 8
    quants = torch.nn.functional.pad(rows.quants, (0, 0, 0, 0, 0, padding))
    # [group, row, super, block, word, byte] -> [group, super, block, word, row, byte]
    parts = [quants.view(groups, row_group, supers, 8, quant_bytes // 4, 4).permute(0, 2, 3, 4, 1, 5)]
    for scale in rows.scales:
        padded = torch.nn.functional.pad(scale, (0, 0, 0, 0, 0, padding))  # [rows, supers, count]
        # [group, row, super, count] -> [group, super, count, row]: a row group's values side by side
        parts.append(padded.view(groups, row_group, supers, -1).permute(0, 2, 3, 1).contiguous().view(torch.uint8))
    return torch.cat([part.reshape(groups, supers, -1) for part in parts], dim=-1).reshape(-1).contiguous()


def _super_block_rows(format: BlockFormat, picked: torch.Tensor, within: torch.Tensor, row_group: int) -> BlockRows:
    """Row `within[i]` of row group `picked[i]` (uint8 [n, super-blocks, a row group's
    super-block bytes]) as BlockRows: the inverse of _interleave_super_blocks."""
    n, supers, _ = picked.shape
    every = torch.arange(n)
    quant_bytes = _SUPER_QUANT_BYTES[format]
    offset = 8 * quant_bytes * row_group
    quants = picked[..., :offset].reshape(n, supers, 8, quant_bytes // 4, row_group, 4)
    quants = quants.permute(0, 4, 1, 2, 3, 5)[every, within].reshape(n, supers * 8, quant_bytes)
    scales = []
    for count, dtype in SUPER_BLOCK_SCALES[format]:
        size = count * row_group * dtype.itemsize
        part = picked[..., offset : offset + size].contiguous().view(dtype).reshape(n, supers, count, row_group)
        scales.append(part.permute(0, 3, 1, 2)[every, within])  # [n, supers, count]
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
