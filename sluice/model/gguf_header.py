"""A GGUF file's header, walked without building its values.

`gguf.GGUFReader` turns every metadata entry into numpy objects up front, a tokenizer's
arrays included (seconds for a large vocabulary). Before any process starts, the CLI only
needs `general.architecture` and to know that every tensor the header lists lies within
the file; walking the header for that takes a fraction of a second.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_DEFAULT_ALIGNMENT = 32


class GGUFHeaderError(ValueError):
    pass


def read_architecture(path: str | Path) -> str:
    """`general.architecture` of the GGUF file at `path`, after checking that the file holds
    every tensor its header lists; GGUFHeaderError naming what is wrong."""
    with open(path, "rb") as f:
        if f.read(4) != struct.pack("<I", GGUF_MAGIC):
            raise GGUFHeaderError(f"{path} is not a GGUF file (bad magic)")
        _version, num_tensors, num_entries = _unpack(f, "<IQQ")
        architecture, alignment = None, _DEFAULT_ALIGNMENT
        for _ in range(num_entries):
            key = _string(f)
            value_type = GGUFValueType(_unpack(f, "<I")[0])
            if key == "general.architecture" and value_type == GGUFValueType.STRING:
                architecture = _string(f)
            elif key == "general.alignment" and value_type == GGUFValueType.UINT32:
                (alignment,) = _unpack(f, "<I")
            else:
                _skip(f, value_type)
        ends = []
        for _ in range(num_tensors):
            name = _string(f)
            (num_dims,) = _unpack(f, "<I")
            dims = _unpack(f, f"<{num_dims}Q")
            tensor_type, offset = _unpack(f, "<IQ")
            try:
                block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor_type)]
            except ValueError:
                raise GGUFHeaderError(f"{path}: tensor {name} has an unknown block type {tensor_type}") from None
            elements = 1
            for dim in dims:
                elements *= dim
            ends.append((offset + elements // block_size * block_bytes, name))
        data_start = -(-f.tell() // alignment) * alignment
        size = Path(path).stat().st_size
        end, name = max(ends, default=(0, ""))
        if data_start + end > size:
            raise GGUFHeaderError(
                f"{path} is truncated: tensor {name} ends at byte {data_start + end:,}, the file has {size:,}"
            )
    if architecture is None:
        raise GGUFHeaderError(f"{path} has no general.architecture")
    return architecture


def _unpack(f: BinaryIO, layout: str) -> tuple:
    size = struct.calcsize(layout)
    data = f.read(size)
    if len(data) != size:
        raise GGUFHeaderError(f"{f.name} is truncated (its header ends early)")
    return struct.unpack(layout, data)


def _string(f: BinaryIO) -> str:
    (length,) = _unpack(f, "<Q")
    data = f.read(length)
    if len(data) != length:
        raise GGUFHeaderError(f"{f.name} is truncated (its header ends early)")
    return data.decode("utf-8", errors="replace")


def _skip(f: BinaryIO, value_type: GGUFValueType) -> None:
    if value_type == GGUFValueType.STRING:
        _string(f)
    elif value_type == GGUFValueType.ARRAY:
        item_type = GGUFValueType(_unpack(f, "<I")[0])
        (count,) = _unpack(f, "<Q")
        if item_type in _SCALAR_FORMATS:
            f.seek(count * struct.calcsize(_SCALAR_FORMATS[item_type]), 1)
        else:
            for _ in range(count):
                _skip(f, item_type)
    else:
        _unpack(f, _SCALAR_FORMATS[value_type])
