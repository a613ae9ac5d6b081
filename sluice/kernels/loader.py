"""Builds the C kernels in this folder once per source version and loads them with ctypes.

The build is a single gcc call (about a second); the shared library is cached under
~/.cache/sluice/kernels, keyed by the source's hash, so later starts only load it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads the libgomp that the kernels' OpenMP must share)

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class KernelUnavailable(RuntimeError):
    pass


def cpu_supports_kernels() -> bool:
    """AVX2 and FMA, read from /proc/cpuinfo (Linux x86-64 only)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _cache_dir() -> Path:
    return Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice")) / "kernels"


@functools.cache
def load_kernels() -> ctypes.CDLL:
    """The compiled kernels; raises KernelUnavailable with the reason when they cannot be had."""
    if not cpu_supports_kernels():
        raise KernelUnavailable("the quantized kernels need an x86-64 CPU with AVX2 and FMA")
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise KernelUnavailable("the quantized kernels need a C compiler (gcc) to build once")
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in [*_SOURCES, *_HEADERS]) + " ".join(_FLAGS).encode())
    library = _cache_dir() / f"sluice-kernels-{digest.hexdigest()[:16]}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        # Build into a temporary name and rename: concurrent first starts never see half a file.
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            built = Path(tmp) / library.name
            result = subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise KernelUnavailable(f"building the kernels failed:\n{result.stderr}")
            os.replace(built, library)
    lib = ctypes.CDLL(str(library))
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


_int, _float, _ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
# Every exported function, as its C declaration has it (pointers passed as data_ptr() ints).
_SIGNATURES = {
    # M, N, K, x, weight_type, packed, out, scratch
    "sluice_qgemm": (_int, [_int, _int, _int, _ptr, _int, _ptr, _ptr, _ptr]),
    # M, K
    "sluice_qgemm_scratch_bytes": (ctypes.c_size_t, [_int, _int]),
    # rows, dim, x, w, eps, out
    "sluice_rmsnorm": (None, [_int, _int, _ptr, _ptr, _float, _ptr]),
    # rows, dim, hidden, delta, w, eps, out
    "sluice_add_rmsnorm": (None, [_int, _int, _ptr, _ptr, _ptr, _float, _ptr]),
    # tokens, heads, kv_heads, head_dim, qkv, cos, signed_sin, k_pool, v_pool, slots
    "sluice_rope_store": (None, [_int, _int, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr]),
    # rows, width, gate_up, out
    "sluice_silu_mul": (None, [_int, _int, _ptr, _ptr]),
    # queries, heads, kv_heads, head_dim, max_len, scale, q, q_stride, k_pool, v_pool, slots, slot_rows, seq_lens,
    # out
    "sluice_decode_attention": (_int, [_int, _int, _int, _int, _int, _float, _ptr, ctypes.c_long, _ptr, _ptr, _ptr,
                                       _ptr, _ptr, _ptr]),
    # dims, layers, k_pools, v_pools, M, hidden, cos, signed_sin, out_slots, attn_slots, slot_rows, seq_lens,
    # max_len, scratch
    "sluice_decode_layers": (_int, [_ptr, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int,
                                    _ptr]),
    # dims, M
    "sluice_decode_layers_scratch_bytes": (ctypes.c_size_t, [_ptr, _int]),
}
