"""sluice's GGUF reader gives what `gguf.GGUFReader` gives for the same file: every metadata
value and every tensor's type, shape and bytes; and refuses a broken file in one line."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from sluice.model.gguf_file import GGUFHeaderError, StringArray, read_gguf
from sluice.model_files import default_model_path


def write_every_kind(path: Path) -> Path:
    """A GGUF with metadata of every value type and tensors stored as elements and as blocks."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -100)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_uint32("test.u32", 4_000_000_000)
    writer.add_int32("test.i32", -2_000_000_000)
    writer.add_float32("test.f32", 0.25)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**62))
    writer.add_float64("test.f64", 1e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "Grüße, 世界")
    writer.add_array("test.ints", [3, 1, 4, 1, 5])
    writer.add_array("test.floats", [0.5, -1.5])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.strings", ["a", "", "ünïcode", "last"])
    writer.add_tensor("f32.weight", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16.weight", rng.standard_normal((4, 6)).astype(np.float16))
    writer.add_tensor("vector.weight", rng.standard_normal(7).astype(np.float32))
    # A reader hands blocks over as bytes without decoding them: any bytes will do.
    for kind, width in (("Q8_0", 64), ("Q4_1", 32), ("Q4_K", 256), ("Q6_K", 512)):
        block_type = gguf.GGMLQuantizationType[kind]
        byte_shape = gguf.quants.quant_shape_to_byte_shape((3, width), block_type)
        blocks = rng.integers(0, 256, byte_shape, dtype=np.uint8)
        writer.add_tensor(f"{kind.lower()}.weight", blocks, raw_shape=blocks.shape, raw_dtype=block_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory) -> Path:
    return write_every_kind(tmp_path_factory.mktemp("gguf") / "every-kind.gguf")


def assert_reads_as_gguf_reader(path: Path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    expected_fields = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    fields = {key: value.decode() if isinstance(value, StringArray) else value for key, value in ours.fields.items()}
    assert fields == expected_fields
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape == tuple(int(dim) for dim in reference.shape), mine.name
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


def test_every_value_type_and_tensor_layout_reads_as_gguf_reads_it(every_kind):
    assert_reads_as_gguf_reader(every_kind)
    fields = read_gguf(every_kind).fields
    assert fields["test.string"] == "Grüße, 世界" and fields["test.ints"] == [3, 1, 4, 1, 5]
    assert len(fields["test.strings"]) == 4


def test_the_default_model_reads_as_gguf_reads_it():
    """Its 49 k-token vocabulary and merges stay in the file until asked for."""
    assert_reads_as_gguf_reader(Path(default_model_path()))


def test_a_file_cut_anywhere_is_refused_as_truncated(every_kind, tmp_path):
    whole = every_kind.read_bytes()
    reader = gguf.GGUFReader(every_kind)
    data_end = max(tensor.data_offset + tensor.n_bytes for tensor in reader.tensors)  # padding may follow
    cut = tmp_path / "cut.gguf"
    for end in (10, 30, 200, 400, reader.tensors[0].data_offset, data_end - 1):
        cut.write_bytes(whole[:end])
        with pytest.raises(GGUFHeaderError, match="truncated"):
            read_gguf(cut)


def test_an_empty_file_is_refused(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFHeaderError, match="not a GGUF file"):
        read_gguf(empty)


def test_an_unknown_value_type_is_refused_naming_its_key(tmp_path):
    key = b"test.mystery"
    header = struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, 1) + struct.pack("<Q", len(key)) + key
    path = tmp_path / "mystery.gguf"
    path.write_bytes(header + struct.pack("<I", 99) + bytes(16))
    with pytest.raises(GGUFHeaderError, match=r"metadata test\.mystery holds an unknown value type 99"):
        read_gguf(path)
