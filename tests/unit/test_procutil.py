"""Memory a loading process hands back: the pages of a model file read through a map."""

from __future__ import annotations

import numpy as np

from sluice.procutil import drop_mapped_pages

SIZE = 64 * 2**20


def resident_file_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


def test_read_pages_of_a_file_map_leave_resident_memory_and_read_back_the_same(tmp_path):
    path = tmp_path / "weights.bin"
    expected = np.arange(SIZE // 4, dtype=np.uint32)
    expected.tofile(path)
    mapped = np.memmap(path, dtype=np.uint32, mode="r")
    before = resident_file_kb()
    assert int(mapped.sum(dtype=np.uint64)) == int(expected.sum(dtype=np.uint64))  # every page read
    assert resident_file_kb() - before > SIZE // 1024 // 2
    drop_mapped_pages(mapped)
    assert resident_file_kb() - before < SIZE // 1024 // 4
    assert np.array_equal(mapped, expected)  # the pages come back from the file
