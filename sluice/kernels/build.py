"""Compiles the C kernels in this folder for one instruction set, once per source version.

One gcc call (20-30 s on 2 cores) per instruction set; the shared library is cached under
~/.cache/sluice/kernels (`SLUICE_CACHE_DIR` moves it), keyed by the sources, the flags and
the instruction set, so later starts only load it. No `-march=native`: a build runs on any
CPU that has its instruction set, so the cache may be shared between machines.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from sluice.config import cache_root
from sluice.kernels.cpu import Isa

KERNEL_DIR = Path(__file__).parent
SOURCES = sorted(KERNEL_DIR.glob("*.c"))
HEADERS = sorted(KERNEL_DIR.glob("*.h"))
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")


class KernelUnavailable(RuntimeError):
    """The kernels cannot run here; the message says why."""


def cache_dir() -> Path:
    return cache_root() / "kernels"


def built_library(isa: Isa) -> Path:
    """The path of the library built for `isa`, building it first if needed."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise KernelUnavailable("the C kernels need a C compiler (gcc) to build once")
    flags = [*COMMON_FLAGS, *isa.compiler_flags]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS]) + " ".join(flags).encode())
    library = cache_dir() / f"sluice-kernels-{isa.name}-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build into a temporary name and rename: concurrent first starts never see half a file.
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = Path(tmp) / library.name
        result = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise KernelUnavailable(f"building the {isa.name} kernels failed:\n{result.stderr}")
        os.replace(built, library)
    return library
