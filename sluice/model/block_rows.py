"""A matrix as rows of 32-weight blocks in one of the kernels' formats (q8_0, q4_1, q5_1, and
GGUF's q6_k, q5_k and q4_k super-blocks of eight of them), in plain row order: what a GGUF's
blocks or a rounded float weight become before quantized_linear.py interleaves them for the
kernel. The formats' arithmetic and byte layouts are described on BlockRows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.kernels.contract import BLOCK, BlockFormat

__all__ = [
    "BLOCK",
    "BLOCK_QUANT_BYTES",
    "HIGH_BIT_SHIFTS",
    "SUPER_BLOCK_SCALES",
    "SUPER_QUANT_BYTES",
    "BlockFormat",
    "BlockRows",
    "fused_format",
    "pack_five_bits",
    "pack_nibble_runs",
    "pack_nibbles",
    "unpack_five_bits",
    "unpack_nibbles",
    "unpack_six_bits",
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
    of low nibbles and 8 of high bits (see unpack_six_bits), an int8 scale per 16 weights and a
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


def pack_nibble_runs(runs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 32] runs, each holding one block's 32 weights in its low nibbles and the
    next block's in its high ones (GGUF's Q4_K and Q6_K), -> [..., 2, 16]: those two blocks
    as pack_nibbles packs them. Eight bytes a step (`runs` contiguous in its last dimension):
    loading a 1 B model took seconds a byte at a time."""
    words = runs.view(torch.int64).view(-1, 2, 2)  # [run, weights 0-15 / 16-31 of both blocks, word]
    first, second = words[:, 0], words[:, 1]
    blocks = torch.empty_like(words)  # [run, low / high block, word]
    # A shift moves a nibble into the next byte's half that the mask then drops. Two scratch
    # tensors, each used twice: a fresh one's pages fault in as it is first written.
    own, other = first & _LOW_NIBBLES, second << 4
    torch.bitwise_or(own, other.bitwise_and_(~_LOW_NIBBLES), out=blocks[:, 0])
    torch.bitwise_right_shift(first, 4, out=own).bitwise_and_(_LOW_NIBBLES)
    torch.bitwise_or(own, torch.bitwise_and(second, ~_LOW_NIBBLES, out=other), out=blocks[:, 1])
    return blocks.view(torch.uint8).view(*runs.shape[:-1], 2, BLOCK // 2)


_LOW_NIBBLES = 0x0F0F_0F0F_0F0F_0F0F  # each byte's low nibble in a 64-bit word


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
BLOCK_QUANT_BYTES = {BlockFormat.Q8_0: BLOCK, BlockFormat.Q4_1: BLOCK // 2, BlockFormat.Q5_1: BLOCK // 2 + 4}
SUPER_QUANT_BYTES = {BlockFormat.Q6_K: 24, BlockFormat.Q4_K: 16, BlockFormat.Q5_K: 20}  # a row's per 32 weights

# Four 2-bit fields of a byte, at bits 0, 2, 4, 6: how Q6_K keeps its high bits, in the file
# and in qgemm.c's words (there, field g of a half belongs to word g).
HIGH_BIT_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)


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
    """q6_k's 24 bytes a block, uint8 [..., 24] -> [..., 32] values in [0, 64): the low nibbles
    as pack_nibbles packs them, then 8 bytes of the high two bits, byte 4h + t holding those of
    weight 16h + 4g + t at bits 2g..2g+1 (qgemm.c's q6_k words)."""
    low = unpack_nibbles(quants[..., :16])
    high = (quants[..., 16:].reshape(*quants.shape[:-1], 2, 1, 4) >> HIGH_BIT_SHIFTS) & 3  # [..., half, g, t]
    return low | (high.reshape(*quants.shape[:-1], BLOCK) << 4)


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """float32 of the float16 scales, with 0 (an all-equal block) replaced by 1 to divide by."""
    d = d.float()
    return torch.where(d == 0, 1.0, d)
