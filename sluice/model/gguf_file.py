"""A GGUF file's metadata and tensor table, read straight from a map of the file.

`gguf.GGUFReader` builds numpy objects for every part of every metadata entry up front, a
tokenizer's arrays included: about 6 s for SmolLM2's 49 k vocabulary on a Zen 1 core, and
100+ MB of Python objects, on every server start. This reader decodes the scalars and
strings a model's config needs, leaves string arrays (the vocabulary, the merges) as counted
spans of the file, and gives each tensor as a numpy view of the map, shaped as GGUFReader
shapes it: a few tens of milliseconds for the same file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

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
# Tensor types whose data is read as elements, not as blocks of bytes.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_DEFAULT_ALIGNMENT = 32


class GGUFHeaderError(ValueError):
    pass


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, left in the file: its length, and its items on demand."""

    header: memoryview  # the file's bytes
    offset: int  # where the first item's length is
    count: int

    def __len__(self) -> int:
        return self.count

    def decode(self) -> list[str]:
        items, offset = [], self.offset
        for _ in range(self.count):
            item, offset = _string(self.header, offset)
            items.append(item)
        return items


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order, innermost first: [in, out] for a linear
    data: np.ndarray  # a view of the map: elements in row-major order, or rows of blocks' bytes


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # scalars, strings, lists of scalars, StringArray
    tensors: list[GGUFTensor]
    data: np.memmap  # the whole file
    metadata_end: int  # where the metadata ends and the tensor table begins

    @property
    def metadata(self) -> memoryview:
        """The file's bytes up to the end of its metadata: the version, the counts and every
        key and value, the tokenizer's included."""
        return self.data.data[: self.metadata_end]


def read_architecture(path: str | Path) -> str:
    """`general.architecture` of the GGUF file at `path`, after checking that the file holds
    every tensor its header lists; GGUFHeaderError naming what is wrong."""
    architecture = read_gguf(path).fields.get("general.architecture")
    if not isinstance(architecture, str):
        raise GGUFHeaderError(f"{path} has no general.architecture")
    return architecture


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensors of the GGUF file at `path`; GGUFHeaderError naming what is
    wrong with a file that is not GGUF, ends early, or lists a tensor past its end."""
    try:
        data = np.memmap(path, mode="r")
    except ValueError:  # an empty file cannot be mapped
        raise GGUFHeaderError(f"{path} is not a GGUF file (it is empty)") from None
    header = data.data
    try:
        if bytes(header[:4]) != struct.pack("<I", GGUF_MAGIC):
            raise GGUFHeaderError(f"{path} is not a GGUF file (bad magic)")
        (version, num_tensors, num_entries), offset = _unpack(header, 4, "<IQQ")
        if version not in (2, 3):
            raise GGUFHeaderError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
        fields: dict[str, Any] = {}
        for _ in range(num_entries):
            key, offset = _string(header, offset)
            (value_type,), offset = _unpack(header, offset, "<I")
            try:
                fields[key], offset = _value(header, offset, _value_type(value_type))
            except _UnknownValueType as unknown:
                raise GGUFHeaderError(f"{path}: metadata {key} holds an unknown value type {unknown}") from None
        metadata_end, table = offset, []
        for _ in range(num_tensors):
            name, offset = _string(header, offset)
            (num_dims,), offset = _unpack(header, offset, "<I")
            dims, offset = _unpack(header, offset, f"<{num_dims}Q")
            (type_id, start), offset = _unpack(header, offset, "<IQ")
            try:
                tensor_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFHeaderError(f"{path}: tensor {name} has an unknown block type {type_id}") from None
            table.append((name, tensor_type, dims, start))
        alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFHeaderError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-offset // alignment) * alignment
        tensors = [_tensor(data, data_start, *entry, path=path) for entry in table]
    except struct.error:
        raise GGUFHeaderError(f"{path} is truncated (its header ends early)") from None
    return GGUFFile(fields, tensors, data, metadata_end)


def _tensor(
    data: np.memmap, data_start: int, name: str, tensor_type: GGMLQuantizationType, dims: tuple, start: int, path
) -> GGUFTensor:
    block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
    elements = int(np.prod(dims, dtype=np.int64))
    rows_first = tuple(reversed(dims))
    begin = data_start + start
    end = begin + elements // block_size * block_bytes
    if end > len(data):
        raise GGUFHeaderError(f"{path} is truncated: tensor {name} ends at byte {end:,}, the file has {len(data):,}")
    element_dtype = _ELEMENT_DTYPES.get(tensor_type)
    if element_dtype is not None:
        view = data[begin:end].view(element_dtype).reshape(rows_first)
    elif rows_first and rows_first[-1] % block_size == 0:
        view = data[begin:end].reshape(quant_shape_to_byte_shape(rows_first, tensor_type))
    else:
        raise GGUFHeaderError(
            f"{path}: tensor {name} has rows of {rows_first[-1] if rows_first else 0} weights, "
            f"not a whole number of {tensor_type.name} blocks of {block_size}"
        )
    return GGUFTensor(name, tensor_type, tuple(int(dim) for dim in dims), view)


class _UnknownValueType(Exception):
    pass


def _value_type(type_id: int) -> GGUFValueType:
    try:
        return GGUFValueType(type_id)
    except ValueError:
        raise _UnknownValueType(type_id) from None


def _value(header: memoryview, offset: int, value_type: GGUFValueType) -> tuple[Any, int]:
    if value_type == GGUFValueType.STRING:
        return _string(header, offset)
    if value_type != GGUFValueType.ARRAY:
        (value,), offset = _unpack(header, offset, _SCALAR_FORMATS[value_type])
        return value, offset
    (item_type_id, count), offset = _unpack(header, offset, "<IQ")
    item_type = _value_type(item_type_id)
    if item_type in _SCALAR_FORMATS:
        layout = _SCALAR_FORMATS[item_type]
        end = offset + count * struct.calcsize(layout)
        if end > len(header):
            raise struct.error("array past the end")
        return np.frombuffer(header[offset:end], np.dtype(layout)).tolist(), end
    if item_type == GGUFValueType.STRING:
        strings = StringArray(header, offset, count)
        for _ in range(count):  # lengths only: the items stay in the file
            (length,), offset = _unpack(header, offset, "<Q")
            offset += length
        return strings, offset
    items = []
    for _ in range(count):
        item, offset = _value(header, offset, item_type)
        items.append(item)
    return items, offset


def _unpack(header: memoryview, offset: int, layout: str) -> tuple[tuple, int]:
    return struct.unpack_from(layout, header, offset), offset + struct.calcsize(layout)


def _string(header: memoryview, offset: int) -> tuple[str, int]:
    (length,), start = _unpack(header, offset, "<Q")
    end = start + length
    if end > len(header):
        raise struct.error("string past the end")
    return bytes(header[start:end]).decode("utf-8", errors="replace"), end
