"""Which instruction sets this CPU offers the kernels, best first.

One build of the kernels per instruction set (see build.py); the loader tries them in the
order of `usable_isas()` and keeps the first that builds and passes its self-test.
`SLUICE_DISABLE_ISA` (comma-separated names, e.g. `avx512_vnni`) takes sets out of the
running, for tests and for machines whose hypervisor advertises what it does not run.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

DISABLE_ENV = "SLUICE_DISABLE_ISA"


@dataclass(frozen=True, slots=True)
class Isa:
    name: str
    required_flags: tuple[str, ...]  # as /proc/cpuinfo spells them
    compiler_flags: tuple[str, ...]


_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c")
_AMX_INT8_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c", "amx_tile", "amx_int8")
# Best first. AVX-512 needs F (foundation), BW (byte/word ops), VL and VNNI (vpdpbusd); the
# AMX-INT8 build adds tile multiplies for batches of 16+ rows to it, the AMX-BF16 build bf16
# tiles for prompt rows on top of that.
ISAS = (
    Isa(
        "amx_bf16",
        (*_AMX_INT8_FLAGS, "amx_bf16", "avx512_bf16"),
        (*_AVX512_FLAGS, "-mamx-tile", "-mamx-int8", "-mamx-bf16", "-mavx512bf16"),
    ),
    Isa(
        "amx_int8",
        _AMX_INT8_FLAGS,
        (*_AVX512_FLAGS, "-mamx-tile", "-mamx-int8"),
    ),
    Isa("avx512_vnni", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"), _AVX512_FLAGS),
    Isa("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
)
ISA_NAMES = tuple(isa.name for isa in ISAS)
# Flags worth naming in the start-up line and /get_server_info.
REPORTED_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. not Linux x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def disabled_isas() -> frozenset[str]:
    """The builds SLUICE_DISABLE_ISA takes out; ValueError naming a name it does not know
    (a misspelt switch would leave the path it meant to avoid running)."""
    names = {name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()}
    unknown = sorted(names - {*ISA_NAMES, "avx512", "amx"})
    if unknown:
        known = ", ".join([*ISA_NAMES, "avx512", "amx"])
        raise ValueError(f"{DISABLE_ENV} names {', '.join(unknown)}, which it does not know; known: {known}")
    # Short names users reach for: "avx512" covers every AVX-512 build (AMX's included), "amx" the AMX ones.
    if "avx512" in names:
        names |= {isa for isa in ISA_NAMES if isa != "avx2"}
    if "amx" in names:
        names |= {"amx_int8", "amx_bf16"}
    return frozenset(names)


def supported_isas() -> list[Isa]:
    """Every instruction set of ISAS this CPU has, best first (disabled ones included)."""
    flags = cpu_flags()
    return [isa for isa in ISAS if all(flag in flags for flag in isa.required_flags)]


def usable_isas() -> list[Isa]:
    """The instruction sets to try, best first: supported and not disabled."""
    disabled = disabled_isas()
    return [isa for isa in supported_isas() if isa.name not in disabled]


def isa_by_name(name: str) -> Isa:
    for isa in ISAS:
        if isa.name == name:
            return isa
    raise ValueError(f"unknown instruction set {name!r}; known: {', '.join(ISA_NAMES)}")


def reported_flags() -> list[str]:
    flags = cpu_flags()
    return [flag for flag in REPORTED_FLAGS if flag in flags]
