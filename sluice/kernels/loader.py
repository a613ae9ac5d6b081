"""Loads the best build of the C kernels this CPU runs correctly.

For each instruction set the CPU offers (best first, see cpu.py): build it (once, cached),
run its self-test in a child process (an instruction the CPU or its hypervisor refuses
kills the child, not the server), load it, bind its functions from kernels.h and check its
structs and constants. The first that passes all of that is used; why each better one was
passed over is kept for the start-up log.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
import sys
from dataclasses import dataclass, field

import torch  # noqa: F401  (loads the libgomp that the kernels' OpenMP must share)

from sluice.kernels import contract
from sluice.kernels.build import KernelUnavailable, built_library
from sluice.kernels.cpu import DISABLE_ENV, Isa, disabled_isas, isa_by_name, supported_isas, usable_isas

logger = logging.getLogger(__name__)

SELF_TEST_TIMEOUT_S = 60
_SELF_TEST = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).sluice_self_test())"

__all__ = ["KernelUnavailable", "Kernels", "kernels_available", "load_kernels"]


@dataclass(frozen=True, slots=True)
class Kernels:
    """One loaded build of the kernels."""

    isa: str  # "avx512_vnni" | "avx2"
    lib: ctypes.CDLL = field(repr=False)
    row_group: int  # output rows qgemm interleaves (SLUICE_ROW_GROUP of this build)
    passed_over: tuple[str, ...] = ()  # why better instruction sets were not used

    def describe(self) -> str:
        return self.isa + "".join(f"; {reason}" for reason in self.passed_over)


def _self_test(library: str, isa: Isa) -> None:
    try:
        result = subprocess.run(
            [sys.executable, "-c", _SELF_TEST, library],
            capture_output=True,
            text=True,
            timeout=SELF_TEST_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise KernelUnavailable(f"the {isa.name} self-test did not finish in {SELF_TEST_TIMEOUT_S} s") from None
    if result.returncode < 0:
        raise KernelUnavailable(
            f"the {isa.name} self-test was killed by signal {-result.returncode} (an instruction this CPU refuses?)"
        )
    if result.returncode != 0:
        raise KernelUnavailable(f"the {isa.name} self-test failed check {result.returncode} {result.stderr.strip()}")


def _load(isa: Isa) -> ctypes.CDLL:
    library = str(built_library(isa))
    _self_test(library, isa)
    lib = ctypes.CDLL(library)
    lib.sluice_contract_value.restype = ctypes.c_long
    lib.sluice_contract_value.argtypes = [ctypes.c_char_p]
    contract.check(lib)
    contract.bind(lib)
    return lib


@functools.cache
def load_kernels(isa: str | None = None) -> Kernels:
    """The kernels built for `isa`, or for the best instruction set that works here (None).

    Raises KernelUnavailable with the reason when none can be had.
    """
    if isa is not None:
        wanted = isa_by_name(isa)
        if wanted not in supported_isas():
            raise KernelUnavailable(f"this CPU lacks {isa} ({', '.join(wanted.required_flags)})")
        return _first_that_loads([wanted], [])
    disabled = disabled_isas()
    passed_over = [
        f"{candidate.name} disabled by {DISABLE_ENV}" for candidate in supported_isas() if candidate.name in disabled
    ]
    candidates = usable_isas()
    if not candidates:
        reason = f" ({DISABLE_ENV}={','.join(sorted(disabled))})" if disabled else ""
        raise KernelUnavailable(f"the C kernels need an x86-64 CPU with AVX2, FMA and F16C{reason}")
    return _first_that_loads(candidates, passed_over)


def _first_that_loads(candidates: list[Isa], passed_over: list[str]) -> Kernels:
    """The first candidate that builds, passes its self-test and agrees with the contract."""
    for candidate in candidates[:-1]:
        try:
            return _kernels(candidate, _load(candidate), passed_over)
        except (KernelUnavailable, contract.ContractMismatch) as error:
            logger.warning("kernels: %s not used: %s", candidate.name, error)
            passed_over.append(f"{candidate.name} not used: {error}")
    try:
        return _kernels(candidates[-1], _load(candidates[-1]), passed_over)
    except contract.ContractMismatch as error:
        raise KernelUnavailable(str(error)) from None


def _kernels(isa: Isa, lib: ctypes.CDLL, passed_over: list[str]) -> Kernels:
    return Kernels(isa.name, lib, lib.sluice_contract_value(b"SLUICE_ROW_GROUP"), tuple(passed_over))


@functools.cache
def kernels_available() -> bool:
    """Whether some build of the kernels works here (logs why not, once)."""
    try:
        load_kernels()
    except KernelUnavailable as error:
        logger.warning("C kernels unavailable: %s", error)
        return False
    return True
