"""A GGUF file's quantized matrices as the kernels' block rows, read from the file's own
blocks wherever the kernels hold the same numbers:

    Q8_0  -> q8_0, the same blocks (d, 32 int8 quants)
    Q4_1  -> q4_1, the same blocks (d, m, 32 nibbles)
    Q4_0  -> q4_1 with m = -8 d (w = d (q - 8); exact in float16)
    Q4_K  -> q4_k, the same numbers (a 256-weight super-block of 8 blocks of 32, each with a
             6-bit scale sc and minimum mn, w = (d sc) q - (dmin mn)) repacked; or
          -> q4_1: each block becomes a q4_1 block with d' = d sc and m' = -dmin mn rounded
             to float16. The 4-bit quants are the file's; the one rounding moves a block's
             scale by at most 2^-11 of itself.
    Q5_K  -> q5_k, the same numbers (Q4_K's with a fifth bit a quant) repacked
    Q5_1  -> q5_1, the same numbers (d, m, 32 fifth bits, 32 nibbles) repacked
    Q5_0  -> q5_1 with m = -16 d (w = d (q - 16); exact in float16)
    Q6_K  -> q6_k, the same numbers (6-bit quants, int8 scales per 16, d per 256) repacked
    other quantized types (Q2_K, Q3_K, IQ4_NL, ...) -> dequantized, then rounded to q8_0
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch

from sluice.kernels.contract import SUPER_BLOCK  # weights per K-quant super-block
from sluice.model.block_rows import (
    BLOCK,
    HIGH_BIT_SHIFTS,
    SUPER_QUANT_BYTES,
    BlockFormat,
    BlockRows,
    pack_five_bits,
    pack_nibble_runs,
    unpack_nibbles,
)

_Q4_K_BYTES: Final = 144  # d, dmin (float16), 12 bytes of packed scales and minimums, 128 of nibbles
_Q5_K_BYTES: Final = 176  # as Q4_K, with 32 bytes of fifth bits before the nibbles
_Q6_K_BYTES: Final = 210  # 128 bytes of low nibbles, 64 of high bits, 16 int8 scales, d (float16)

_BLOCK_BITS: Final = torch.arange(8, dtype=torch.uint8).view(8, 1)  # a byte's bits, one per block of a super-block

_ROUNDED_AT_ONCE: Final = 2**20  # weights dequantized and rounded to another format in one go

# The GGUF types whose blocks become q4_1, and q5_1, without rounding their quants again.
FOUR_BIT_TYPES: Final = ("Q4_0", "Q4_1", "Q4_K")
FIVE_BIT_TYPES: Final = ("Q5_0", "Q5_1")


def block_rows(data: np.ndarray, type_name: str, shape: tuple[int, int], format: BlockFormat) -> BlockRows:
    """The [out, in] matrix stored in `data` (the tensor's raw bytes, maybe a read-only map
    of the file) as `format` blocks; every part is copied out of the file."""
    import gguf

    rows, columns = shape
    raw = np.asarray(data).view(np.uint8)
    if type_name in ("Q8_0", "Q4_1", "Q4_0", "Q5_0", "Q5_1"):
        raw = raw.reshape(rows, columns // BLOCK, -1)  # one row of bytes per block
    if type_name == "Q8_0" and format is BlockFormat.Q8_0:
        return BlockRows(format, _bytes(raw[..., 2:]), [_float16(raw[..., :2])])
    if type_name == "Q4_1" and format is BlockFormat.Q4_1:
        return BlockRows(format, _bytes(raw[..., 4:]), [_float16(raw[..., :2]), _float16(raw[..., 2:4])])
    if type_name == "Q4_0" and format is BlockFormat.Q4_1:
        d = _float16(raw[..., :2])
        return BlockRows(format, _bytes(raw[..., 2:]), [d, d * -8])
    if type_name in ("Q5_0", "Q5_1") and format is BlockFormat.Q5_1:
        rows_of_file = _q5_rows(raw, has_minimum=type_name == "Q5_1")
        if rows_of_file is not None:
            return rows_of_file
    if type_name == "Q4_K" and format in (BlockFormat.Q4_K, BlockFormat.Q4_1):
        rows_of_file = _k_quant_rows(raw.reshape(-1, _Q4_K_BYTES), rows, columns)  # one row per super-block
        return rows_of_file if format is BlockFormat.Q4_K else _q4_k_as_q4_1(rows_of_file)
    if type_name == "Q5_K" and format is BlockFormat.Q5_K:
        return _k_quant_rows(raw.reshape(-1, _Q5_K_BYTES), rows, columns)
    if type_name == "Q6_K" and format is BlockFormat.Q6_K:
        return _q6_k_rows(raw.reshape(-1, _Q6_K_BYTES), rows, columns)
    # Rounded a slice of rows at a time: the float copy and the rounding's temporaries of a
    # whole 1 B-model matrix are hundreds of MB at the peak of loading.
    kind = gguf.GGMLQuantizationType[type_name]
    raw = raw.reshape(rows, -1)  # one row of bytes per matrix row
    step = max(1, _ROUNDED_AT_ONCE // columns)
    slices = []
    for start in range(0, rows, step):
        array = gguf.quants.dequantize(raw[start : start + step], kind)
        slices.append(BlockRows.quantize(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)), format))
    return BlockRows.stack(slices)


def _k_quant_rows(supers: np.ndarray, rows: int, columns: int) -> BlockRows:
    """Q4_K (144 bytes a super-block) or Q5_K (176) super-blocks, one a row of `supers`, as q4_k
    or q5_k rows."""
    from gguf.quants import Q4_K

    five_bits = supers.shape[1] == _Q5_K_BYTES
    nibbles_start = 48 if five_bits else 16  # Q5_K's 32 bytes of fifth bits come first
    supers_per_row = columns // SUPER_BLOCK
    d = _float16(supers[:, 0:2]).reshape(rows, supers_per_row, 1)
    dmin = _float16(supers[:, 2:4]).reshape(rows, supers_per_row, 1)
    sc, mn = (
        torch.from_numpy(part.astype(np.uint8)).reshape(rows, supers_per_row, 8)
        for part in Q4_K.get_scale_min(np.array(supers[:, 4:16]))
    )
    # 128 bytes: four runs of 32, run j holding block 2j in its low nibbles and 2j + 1 in its high ones.
    runs = _bytes(supers[:, nibbles_start:]).reshape(-1, 4, BLOCK)
    scales = [sc, mn, d, dmin]
    if not five_bits:
        return BlockRows(BlockFormat.Q4_K, pack_nibble_runs(runs).reshape(rows, -1, BLOCK // 2), scales)
    q = torch.stack((runs & 0x0F, runs >> 4), dim=2).reshape(-1, 8, BLOCK)  # [super, block, weight]
    # Bit b of byte l of the fifth bits is weight l's of block b.
    fifth = (_bytes(supers[:, 16:48]).reshape(-1, 1, BLOCK) >> _BLOCK_BITS) & 1
    return BlockRows(BlockFormat.Q5_K, pack_five_bits((q | fifth << 4).reshape(rows, -1, BLOCK)), scales)


def _q5_rows(raw: np.ndarray, has_minimum: bool) -> BlockRows | None:
    """Q5_1 (d, m, 4 bytes of fifth bits, 16 of nibbles) or Q5_0 (no m) blocks, uint8 [rows,
    blocks, block bytes], as q5_1 rows; None where Q5_0's -16 d overflows float16."""
    d = _float16(raw[..., :2])
    minimum = _float16(raw[..., 2:4]) if has_minimum else d * -16
    if not has_minimum and not torch.isfinite(minimum).all():
        return None
    start = 4 if has_minimum else 2
    # Bit j of the little-endian word is weight j's fifth bit; byte j's nibbles are weights j and j + 16.
    fifth = (_bytes(raw[..., start : start + 4]).unsqueeze(-1) >> _BLOCK_BITS.view(1, 8)) & 1  # [.., byte, bit]
    q = unpack_nibbles(_bytes(raw[..., start + 4 :])) | fifth.reshape(*raw.shape[:-1], BLOCK) << 4
    return BlockRows(BlockFormat.Q5_1, pack_five_bits(q), [d, minimum])


def _q4_k_as_q4_1(rows: BlockRows) -> BlockRows:
    """q4_k rows as q4_1 blocks with the same quants: each block's scale d sc and minimum
    -dmin mn rounded to float16."""
    sc, mn, d, dmin = (part.float() for part in rows.scales)  # [rows, supers, 8 or 1]
    count = len(rows)
    scale = (d * sc).half().reshape(count, -1)
    minimum = (-(dmin * mn)).half().reshape(count, -1)
    return BlockRows(BlockFormat.Q4_1, rows.quants, [scale, minimum])


def _q6_k_rows(supers: np.ndarray, rows: int, columns: int) -> BlockRows:
    # Each half of 128 weights: 64 bytes of nibbles and 32 of high bits. Quarter i of the half
    # (weights 32i .. 32i + 31) takes the low (i = 0, 1) or high (2, 3) nibbles of bytes
    # 0..31 (i even) or 32..63 (i odd), and bits 2i..2i+1 of the 32 high bytes.
    low = _bytes(supers[:, :128]).reshape(-1, 2, 2, BLOCK)  # [super, half, first/second 32 bytes, byte]
    block_bytes = SUPER_QUANT_BYTES[BlockFormat.Q6_K]  # 16 of low nibbles, 8 of high bits
    quants = torch.empty(len(supers), 2, 4, block_bytes, dtype=torch.uint8)  # [super, half, quarter, byte]
    # Quarter i is at 2 (i // 2) + i % 2: [.., low/high nibbles, first/second 32 bytes, ..]
    quants[..., : BLOCK // 2].unflatten(2, (2, 2)).copy_(pack_nibble_runs(low).transpose(2, 3))
    quants[..., BLOCK // 2 :].copy_(_q6_k_high_bits(_bytes(supers[:, 128:192])))
    blocks_per_row = columns // BLOCK
    quants = quants.view(rows, blocks_per_row, block_bytes)
    supers_per_row = columns // SUPER_BLOCK
    sub_scales = _bytes(supers[:, 192:208]).view(torch.int8).reshape(rows, supers_per_row, 16)
    d = _float16(supers[:, 208:210]).reshape(rows, supers_per_row, 1)
    return BlockRows(BlockFormat.Q6_K, quants, [sub_scales, d])


def _q6_k_high_bits(high: torch.Tensor) -> torch.Tensor:
    """Q6_K's 64 bytes of high bits a super-block, uint8 [supers, 64], -> [supers, half, quarter, 8]:
    each block's 8 bytes of them in q6_k's order (see unpack_six_bits), four bytes a step. In the
    file, byte l of a half holds weight l of quarter i at bits 2i..2i+1: as 32-bit words, word
    4h + g holds weight 16h + 4g + t of every quarter in its byte t."""
    words = high.view(torch.int32).reshape(-1, 2, 1, 2, 4)  # [super, half, quarter (to broadcast), h, g]
    fields = (words >> _QUARTER_SHIFTS) & 0x0303_0303  # [super, half, quarter, h, g]: 2 bits a byte
    packed = fields[..., 0] | (fields[..., 1] << 2) | (fields[..., 2] << 4) | (fields[..., 3] << 6)
    return packed.contiguous().view(torch.uint8).reshape(-1, 2, 4, 8)


_QUARTER_SHIFTS: Final = HIGH_BIT_SHIFTS.to(torch.int32).view(4, 1, 1)  # a quarter's bits in a byte


def _bytes(part: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(part, dtype=np.uint8))  # a copy: the file's map is read-only


def _float16(pairs: np.ndarray) -> torch.Tensor:
    """uint8 [..., 2] little-endian float16 bytes -> float16 [...]."""
    return torch.from_numpy(np.array(pairs, dtype=np.uint8).view(np.float16)[..., 0])
