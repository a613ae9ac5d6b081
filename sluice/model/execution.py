"""Which backend, activation dtype and KV-cache dtype a model runs with on this CPU.

Chosen once, when the model loads, from `--dtype`, `--kv-cache-dtype` and what the CPU
and the kernels offer:

    --dtype auto      float32 on the C kernels wherever they run (every x86-64 CPU with
                      AVX2: the fastest path there is, and batch-invariant); elsewhere
                      bfloat16 torch ops where oneDNN has bf16 kernels, else float32 torch ops
    --dtype float32   the C kernels where they run, else float32 torch ops (with a warning)
    --dtype bfloat16  torch ops in bfloat16 (the kernels take float32 activations); on a CPU
                      without bf16 instructions torch emulates them (a warning says so)

    --kv-cache-dtype auto   float16 on the kernels (half the bytes attention reads, no
                            change in greedy output on the parity tests), the model dtype on torch
    --kv-cache-dtype fp8_e5m2  a byte an element (a float16's high byte, no scales): half of
                            float16's bytes again, lossy (greedy output drifts from float16's)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sluice.kernels.cpu import cpu_model, reported_flags
from sluice.kernels.loader import KernelUnavailable, load_kernels
from sluice.kernels.ops import KernelOps
from sluice.model.backend import Backend, KernelBackend, TorchBackend

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e5m2": torch.float8_e5m2,
}
DTYPE_CHOICES = ("auto", *DTYPES)
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)


@dataclass(frozen=True, slots=True)
class Execution:
    backend: Backend
    dtype: torch.dtype  # activations and dense weights
    kv_dtype: torch.dtype
    why: str  # how the choice came about, for the start-up log

    @property
    def uses_kernels(self) -> bool:
        return isinstance(self.backend, KernelBackend)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kv_dtype_name(dtype: torch.dtype) -> str:
    """A KV pool dtype as --kv-cache-dtype names it (fp8_e5m2, where torch says float8_e5m2)."""
    return next(name for name, kv_dtype in KV_CACHE_DTYPES.items() if kv_dtype == dtype)


def choose_execution(dtype: str | torch.dtype = "auto", kv_cache_dtype: str = "auto") -> Execution:
    if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, not {kv_cache_dtype!r}")
    if isinstance(dtype, str):
        if dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, not {dtype!r}")
        wanted = None if dtype == "auto" else DTYPES[dtype]
    else:
        wanted = dtype

    backend: Backend
    if wanted in (None, torch.float32):
        try:
            backend, activations = KernelBackend(KernelOps(load_kernels())), torch.float32
            why = "float32 activations on the C kernels"
        except KernelUnavailable as error:
            backend = TorchBackend()
            bf16 = wanted is None and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            activations = torch.bfloat16 if bf16 else torch.float32
            why = f"torch ops in {_dtype_name(activations)}: the C kernels are unavailable ({error})"
            logger.warning("C kernels unavailable, running torch ops: %s", error)
    else:
        backend, activations = TorchBackend(), wanted
        why = f"torch ops in {_dtype_name(wanted)} (--dtype {_dtype_name(wanted)}; the C kernels take float32)"
        if wanted == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            emulated = (
                "this CPU has no bf16 instructions: torch emulates bfloat16, several times slower than --dtype auto"
            )
            why = f"{why}; {emulated}"
            logger.warning("--dtype bfloat16: %s", emulated)

    if kv_cache_dtype == "auto":
        kv_dtype = torch.float16 if isinstance(backend, KernelBackend) else activations
    else:
        kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    return Execution(backend, activations, kv_dtype, why)


def describe(execution: Execution, weight_formats: list[str]) -> dict[str, str]:
    """What runs, for the start-up log line and /get_server_info.

    weight_formats: the block formats the projections use (empty: dense weights).
    """
    dense = f"dense {_dtype_name(execution.dtype)} torch F.linear"
    if isinstance(execution.backend, KernelBackend):
        isa = execution.backend.isa
        dots = "AVX2 maddubs, 8-row groups" if isa == "avx2" else "AVX-512 VNNI vpdpbusd, 16-row groups"
        if weight_formats:
            gemv = f"{'+'.join(weight_formats)} blocks x int8 activations ({dots})"
            tiled = [f for f in weight_formats if f != "q5_1"]  # q5_1 takes no int8 tiles (qgemm.c)
            if isa in ("amx_int8", "amx_bf16") and tiled:
                gemm = (
                    f"AMX-INT8 tiles of 16 activation rows (the last one partial) for 6+ rows of {'+'.join(tiled)}, "
                    "fewer rows as GEMV"
                )
            else:
                gemm = "the GEMV kernel, 4 activation rows per weight load (8 for super-blocks on AVX-512)"
            if isa == "amx_bf16":
                gemm = f"prompt rows: AMX-BF16 tiles, weights dequantized once per 1 MiB of rows; decode rows: {gemm}"
        else:
            gemv = gemm = dense
        attention = f"C kernel, every token at its position, {_kv_dtype_name(execution.kv_dtype)} KV"
        if isa == "amx_bf16":
            attention += "; prompt tokens: QK^T and PV on AMX-BF16 tiles"
        isa_text = execution.backend.ops.kernels.describe()
    else:
        gemv = gemm = dense
        attention = f"torch SDPA, {_kv_dtype_name(execution.kv_dtype)} KV"
        isa_text = "none"
    return {
        "cpu": cpu_model(),
        "cpu_flags": " ".join(reported_flags()),
        "backend": execution.backend.name,
        "kernels_isa": isa_text,
        "activations": _dtype_name(execution.dtype),
        "gemv": gemv,
        "gemm": gemm,
        "attention": attention,
        "kv_cache_dtype": _kv_dtype_name(execution.kv_dtype),
        "why": execution.why,
    }
