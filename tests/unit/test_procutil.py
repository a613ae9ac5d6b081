"""Memory a loading process hands back: the pages of a model file read through a map; the
freed memory a serving process keeps for its next step; the memory a process may use."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from sluice.procutil import cgroup_memory_limits, drop_mapped_pages, usable_memory_bytes

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


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_usable_memory_is_the_lowest_memory_cgroup_limit_on_the_way_up(tmp_path):
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self_cgroup"
    # cgroup v2: the process's own cgroup is unlimited, its parent is limited to 1 GiB.
    write(self_cgroup, "0::/pods/pod1/app\n")
    write(root / "pods/pod1/app/memory.max", "max\n")
    write(root / "pods/pod1/memory.max", f"{2**30}\n")
    write(root / "memory.max", "max\n")
    assert cgroup_memory_limits(str(root), str(self_cgroup)) == [2**30]
    assert usable_memory_bytes(str(root), str(self_cgroup)) == min(machine, 2**30)
    # cgroup v1, as a container sees it: only its own root, with a limit.
    write(self_cgroup, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    write(root / "memory/memory.limit_in_bytes", f"{3 * 2**30}\n")
    assert cgroup_memory_limits(str(root), str(self_cgroup)) == [3 * 2**30]
    # No cgroup file system, or no limit: the machine's memory.
    assert usable_memory_bytes(str(tmp_path / "none"), str(self_cgroup)) == machine
    assert usable_memory_bytes(str(root), str(tmp_path / "absent")) == machine
