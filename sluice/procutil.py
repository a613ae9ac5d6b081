"""What every child process does first: die with its parent, log; keeping torch out of the
processes that run no tensors; handing freed heap and read file maps back to the OS; and
keeping a loaded model's objects out of the garbage collector's full passes."""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import mmap
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def become_child_process(name: str, log_level: str, on_exit: Callable[[], None] | None = None) -> None:
    """Tie this process's life to its parent's and set up its log.

    SIGTERM (from the parent, or sent when the parent dies) runs `on_exit` and ends the
    process at once: a child holds nothing that needs an orderly shutdown.
    """
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s [{name}] %(levelname)s %(message)s")

    def exit_now(*_):
        if on_exit is not None:
            on_exit()
        os._exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when children stop
    signal.signal(signal.SIGTERM, exit_now)
    die_with_parent(name, signal.SIGTERM)


def keep_torch_out() -> bool:
    """Declare that this process runs no tensors: torch is not imported in it from now on.

    transformers imports torch whenever it is installed, even to load a tokenizer, which
    costs each process ~190 MB resident. With torch's entry in `sys.modules` set to None,
    `importlib.util.find_spec` reports it missing, transformers loads the tokenizer alone,
    and an `import torch` raises ImportError. False when torch or transformers (which decides
    at import whether torch is there) was imported already.
    """
    if sys.modules.get("torch") is not None or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers' advice "PyTorch was not found" is expected here, not news.
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    return True


def die_with_parent(name: str, death_signal: int = signal.SIGKILL) -> None:
    """Get `death_signal` when the parent dies, even by SIGKILL; name the process for `ps`."""
    parent_pid = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, death_signal)
        # The name `ps` and psutil show (at most 15 bytes), e.g. "sluice-schedule".
        libc.prctl(PR_SET_NAME, f"sluice-{name}".encode()[:15])
    except OSError:
        pass
    # prctl misses a parent that died before the call; the watcher also covers non-Linux.
    threading.Thread(target=_signal_when_orphaned, args=(parent_pid, death_signal), daemon=True).start()


def _signal_when_orphaned(parent_pid: int, death_signal: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), death_signal)


def is_alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (exited, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def usable_memory_bytes(cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int:
    """The machine's memory, or less where this process's memory cgroup (a container's, say)
    is limited to less."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = cgroup_memory_limits(cgroup_root, self_cgroup)
    return min([memory, *limits])


def cgroup_memory_limits(cgroup_root: str, self_cgroup: str) -> list[int]:
    """The memory limits set on this process's cgroup and its ancestors that the cgroup
    filesystem shows (v2 memory.max, v1 memory.limit_in_bytes); none where it shows none."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [part for part in path.split("/") if part]
        # The cgroup's own folder and each ancestor's (in a container, often only the root).
        for depth in range(len(parts), -1, -1):
            try:
                with open(os.path.join(base, *parts[:depth], name)) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit():
                limits.append(int(text))
    return limits


def release_freed_memory() -> None:
    """Hand the heap freed so far back to the OS (glibc's malloc_trim; a no-op elsewhere).
    Loading a model frees the float copies its blocks were made from, gigabytes at 1 B
    parameters, which glibc would otherwise keep resident."""
    trim = _glibc_function("malloc_trim")
    if trim is not None:
        trim(0)


# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
REUSED_ALLOCATION_BYTES = 1 << 30


def keep_freed_memory_for_reuse() -> None:
    """Let glibc serve allocations of up to 1 GiB from its heap and keep up to 1 GiB it frees.

    By default an allocation over 32 MiB (and, before the threshold adapts, one over 128 KiB)
    is a fresh map of its own, and its pages fault in one by one every time: a 512-token
    prompt step of a 1 B model allocates a [512, 16384] float32 output for each layer's
    gate/up projection, and on this project's VMs faulting in those 32 MiB took as long as the
    multiplication (17 of 36 ms). Kept in the heap, the next step reuses the same pages.
    Peak resident memory is unchanged; after a burst of long prompts the process keeps its
    peak instead of shrinking. Called by the Scheduler process once its model is loaded
    (loading frees gigabytes of float copies, and gives them back with malloc_trim)."""
    mallopt = _glibc_function("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, REUSED_ALLOCATION_BYTES)
        mallopt(M_TRIM_THRESHOLD, REUSED_ALLOCATION_BYTES)


def freeze_live_objects() -> None:
    """Keep the objects alive now out of every later garbage collection.

    A full collection walks every object the collector tracks: with a 1 B model loaded the
    Scheduler process holds about 178,000 (torch's, transformers', the model's), and the full
    collection that came every few hundred decode steps held one step up by about 130 ms (16
    streams of a Llama-3.2-1B-shaped body: longest of 150 steps 208 ms, against 96 ms frozen).
    Frozen, a collection walks only what was made since. Objects frozen before are thawed first,
    so that what a weight update left unreferenced can still be collected. Called by the
    Scheduler process once its model is loaded and after each weight update."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@functools.cache
def _glibc_function(name: str) -> Callable[..., int] | None:
    """A glibc function, opened once (loading calls release_freed_memory after every matrix);
    None where the C library has no such function."""
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def drop_mapped_pages(array: np.memmap) -> None:
    """Take the pages of a read-only file map out of this process's resident memory (they
    stay in the page cache and come back on the next read). A model file read through a map
    otherwise counts in full against the process while its weights are copied out of it."""
    mapping = getattr(array, "_mmap", None)
    if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED)
