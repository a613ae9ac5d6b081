"""Memory a loading process hands back: the pages of a model file read through a map; and
the freed memory a serving process keeps for its next step."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

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


# A child process allocates 32 MiB (a 512-token step's gate/up output of a 1 B model), frees
# it, allocates it again and prints the page faults of the second allocation.
# glibc's malloc, as torch's CPU allocator calls it (numpy asks for huge pages instead).
SECOND_ALLOCATION_FAULTS = """
import ctypes, resource, sys
from sluice.procutil import keep_freed_memory_for_reuse
if sys.argv[1] == "reuse":
    keep_freed_memory_for_reuse()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def touch_and_free(size):
    pointer = libc.malloc(size)
    ctypes.memset(pointer, 1, size)
    libc.free(pointer)
touch_and_free(32 * 2**20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch_and_free(32 * 2**20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_allocation_is_reused_without_faulting_its_pages_in_again():
    def faults(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", SECOND_ALLOCATION_FAULTS, mode], check=False, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    pages = 32 * 2**20 // 4096
    assert faults("default") > pages // 2  # a fresh map: every page faults in again
    assert faults("reuse") < pages // 16


FROZEN_CYCLES = """
import gc, weakref
from sluice.procutil import freeze_live_objects

class Node:
    pass

def cycle():
    first, second = Node(), Node()
    first.other, second.other = second, first
    return weakref.ref(first), first

old, kept = cycle()
freeze_live_objects()
del kept
gc.collect()
print(old() is not None)  # frozen: a full collection passes it by
new, made_later = cycle()
del made_later
gc.collect()
print(new() is None)  # made after the freeze: collected as ever
freeze_live_objects()
print(old() is None)  # thawed before the next freeze: collected
"""


def test_frozen_objects_skip_collections_until_the_next_freeze_thaws_them():
    # In a child: freezing is the whole process's state.
    run = subprocess.run([sys.executable, "-c", FROZEN_CYCLES], check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True", "True"]
