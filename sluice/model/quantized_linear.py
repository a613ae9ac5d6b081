"""Linear weights kept in 32-weight blocks (q8_0, q4_1) and multiplied by the C kernel.

A decode step reads every weight once, so its speed is set by bytes per weight: 1.06 for
q8_0 and 0.625 for q4_1 against 4 for float32. Prefill is bound by arithmetic instead,
where the dense float matmul is as fast. So decode tokens go through the kernel and
prefill tokens through the dense weight, which the model keeps too (`RowRoute`); a token's
path depends only on its own request, never on what else shares the batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from sluice.kernels.loader import load_kernels

BLOCK = 32


class BlockFormat(enum.IntEnum):
    """The weight_type codes of sluice_qgemm in qgemm.c."""

    Q8_0 = 0  # w = d * q, q int8, one scale per block
    Q4_1 = 1  # w = d * q + m, q 4-bit unsigned, scale and minimum per block


@dataclass(slots=True)
class RowRoute:
    """Which rows of a projection input take the quantized kernel (the others: dense)."""

    quantized_rows: torch.Tensor | None  # int64 row indices; None when all or none do
    dense_rows: torch.Tensor | None
    all_quantized: bool

    @classmethod
    def from_mask(cls, quantized: list[bool]) -> RowRoute:
        if all(quantized):
            return cls(None, None, all_quantized=True)
        if not any(quantized):
            return cls(None, None, all_quantized=False)
        flags = torch.tensor(quantized)
        return cls(flags.nonzero().view(-1), (~flags).nonzero().view(-1), all_quantized=False)

    @property
    def split(self) -> bool:
        return self.quantized_rows is not None


DENSE_ROUTE = RowRoute(None, None, all_quantized=False)


def fused_format(formats: list[BlockFormat | None]) -> BlockFormat | None:
    """The format for weights stacked into one matrix: the most precise of theirs, None if
    any stays dense."""
    if any(format is None for format in formats):
        return None
    return BlockFormat.Q8_0 if BlockFormat.Q8_0 in formats else BlockFormat.Q4_1


@dataclass(slots=True)
class QuantizedLinearWeight:
    format: BlockFormat
    out_features: int
    in_features: int
    q: torch.Tensor  # int8 [out, in] (q8_0) or uint8 [out, in / 2], two weights a byte (q4_1)
    d: torch.Tensor  # float32 [out, in / 32]
    m: torch.Tensor  # float32 [out, in / 32]; q8_0 keeps an empty tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: BlockFormat) -> QuantizedLinearWeight:
        out_features, in_features = weight.shape
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
        blocks = weight.detach().float().reshape(out_features, in_features // BLOCK, BLOCK)
        if format is BlockFormat.Q8_0:
            d = blocks.abs().amax(dim=-1) / 127
            q = torch.round(blocks / torch.where(d == 0, 1.0, d).unsqueeze(-1)).clamp_(-127, 127)
            return cls(format, out_features, in_features, q.to(torch.int8).reshape(out_features, in_features),
                       d.contiguous(), torch.empty(0))
        low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
        d = (high - low) / 15
        q = torch.round((blocks - low.unsqueeze(-1)) / torch.where(d == 0, 1.0, d).unsqueeze(-1)).clamp_(0, 15)
        q = q.to(torch.uint8)
        # GGUF's byte order: byte j of a block holds weight j (low nibble) and j + 16 (high).
        packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
        return cls(format, out_features, in_features, packed.reshape(out_features, in_features // 2).contiguous(),
                   d.contiguous(), low.contiguous())

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight these blocks stand for."""
        shape = (self.out_features, self.in_features // BLOCK, BLOCK)
        if self.format is BlockFormat.Q8_0:
            return (self.q.float().reshape(shape) * self.d.unsqueeze(-1)).reshape(self.out_features, self.in_features)
        packed = self.q.reshape(self.out_features, self.in_features // BLOCK, BLOCK // 2)
        q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()
        return (q * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)).reshape(self.out_features, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ weight.T -> float32 [rows, out]; x is quantized to int8 blocks on the way."""
        x = x.float().contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features)
        scratch = torch.empty(rows * (self.in_features + 8 * (self.in_features // BLOCK)), dtype=torch.uint8)
        load_kernels().sluice_qgemm(
            rows, self.out_features, self.in_features, x.data_ptr(), int(self.format), self.q.data_ptr(),
            self.d.data_ptr(), self.m.data_ptr(), out.data_ptr(), scratch.data_ptr(),
        )
        return out
