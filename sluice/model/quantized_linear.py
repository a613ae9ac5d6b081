"""Linear weights kept in 32-weight blocks (q8_0, q4_1) and multiplied by the C kernel.

A decode step reads every weight once, so its speed is set by bytes per weight: 1.06 for
q8_0 and 0.625 for q4_1 against 4 for float32. A prompt is bound by arithmetic instead,
where the kernel's integer dot products (32 multiply-adds in two instructions) still run
about 1.5x MKL's float32 matmul on an AVX2 CPU. So every token of a quantized model goes
through the kernel, and the model keeps no dense copy of a quantized weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice.kernels.contract import BLOCK, BlockFormat
from sluice.kernels.ops import KernelOps

__all__ = ["BLOCK", "BlockFormat", "QuantizedLinearWeight", "fused_format"]


def fused_format(formats: list[BlockFormat | None]) -> BlockFormat | None:
    """The format for weights stacked into one matrix: the most precise of theirs, None if
    any stays dense."""
    if any(format is None for format in formats):
        return None
    return BlockFormat.Q8_0 if BlockFormat.Q8_0 in formats else BlockFormat.Q4_1


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
        out_features, in_features = weight.shape
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
        blocks = weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)
        if format is BlockFormat.Q8_0:
            d = (blocks.abs().amax(dim=-1) / 127).half()
            q = torch.round(blocks / _nonzero(d).unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
            quants, scales = q.view(torch.uint8), [d]
        else:
            low, high = blocks.amin(dim=-1).half(), blocks.amax(dim=-1)
            d = ((high - low.float()) / 15).half()
            q = torch.round((blocks - low.float().unsqueeze(-1)) / _nonzero(d).unsqueeze(-1)).clamp_(0, 15)
            q = q.to(torch.uint8)
            # GGUF's byte order: byte j of a block holds weight j (low nibble) and j + 16 (high).
            quants, scales = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4), [d, low]
        return cls(format, out_features, in_features, _interleave(quants, scales, ops.row_group), ops)

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight these blocks stand for."""
        quant_bytes = BLOCK if self.format is BlockFormat.Q8_0 else BLOCK // 2
        num_scales = 1 if self.format is BlockFormat.Q8_0 else 2
        quants, scales = _deinterleave(
            self.packed, self.out_features, self.in_features // BLOCK, quant_bytes, num_scales, self.ops.row_group
        )
        shape = (self.out_features, self.in_features)
        if self.format is BlockFormat.Q8_0:
            return (quants.view(torch.int8).float() * scales[0].float().unsqueeze(-1)).reshape(shape)
        q = torch.cat((quants & 0x0F, quants >> 4), dim=-1).float()
        d, m = (scale.float().unsqueeze(-1) for scale in scales)
        return (q * d + m).reshape(shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), in]: rows `ids` of the weight these blocks stand for, read from
        the packed layout (an embedding lookup from a tied, quantized table)."""
        quant_bytes = BLOCK if self.format is BlockFormat.Q8_0 else BLOCK // 2
        group, blocks = self.ops.row_group, self.in_features // BLOCK
        groups = -(-self.out_features // group)
        picked = self.packed.view(groups, blocks, -1)[ids // group]  # [n, blocks, a row group's block bytes]
        within = ids % group
        n = len(ids)
        every = torch.arange(n)
        quants = picked[..., : group * quant_bytes].reshape(n, blocks, quant_bytes // 4, group, 4)
        quants = quants.permute(0, 3, 1, 2, 4)[every, within].reshape(n, blocks, quant_bytes)
        scales = [
            picked[..., start : start + 2 * group].contiguous().view(torch.float16).transpose(1, 2)[every, within]
            for start in range(group * quant_bytes, picked.shape[-1], 2 * group)
        ]
        if self.format is BlockFormat.Q8_0:
            return (quants.view(torch.int8).float() * scales[0].float().unsqueeze(-1)).reshape(n, self.in_features)
        q = torch.cat((quants & 0x0F, quants >> 4), dim=-1).float()
        d, m = (scale.float().unsqueeze(-1) for scale in scales)
        return (q * d + m).reshape(n, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ weight.T -> float32 [rows, out]; x is quantized to int8 blocks on the way."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, the weight takes {self.in_features}")
        return self.ops.qgemm(x, self.format, self.packed, self.out_features)


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
