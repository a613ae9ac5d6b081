"""The choice of backend, activation dtype and KV dtype made when a model loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sluice.kernels.cpu import DISABLE_ENV
from sluice.kernels.loader import kernels_available
from sluice.model.backend import KernelBackend, TorchBackend
from sluice.model.execution import choose_execution, describe

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="the C kernels need an x86-64 CPU with AVX2 and gcc")


@needs_kernels
def test_auto_runs_float32_on_the_kernels_with_a_float16_kv_cache():
    execution = choose_execution("auto", "auto")
    assert isinstance(execution.backend, KernelBackend)
    assert (execution.dtype, execution.kv_dtype) == (torch.float32, torch.float16)
    info = describe(execution, ["q4_1", "q8_0"])
    assert info["backend"] == "kernels" and info["kernels_isa"].startswith(execution.backend.isa)
    assert "q4_1+q8_0" in info["gemv"] and "float16 KV" in info["attention"]


@needs_kernels
def test_the_gemm_line_names_every_format_on_the_int8_tiles_but_q5_1():
    execution = choose_execution("auto", "auto")
    if execution.backend.isa not in ("amx_int8", "amx_bf16"):
        pytest.skip(f"the {execution.backend.isa} build has no int8 tiles")
    gemm = describe(execution, ["q4_k", "q6_k", "q5_1"])["gemm"]
    assert "AMX-INT8 tiles" in gemm and "of q4_k+q6_k," in gemm


def test_bfloat16_asks_for_torch_ops_and_keeps_its_kv_dtype_unless_told():
    execution = choose_execution("bfloat16", "auto")
    assert isinstance(execution.backend, TorchBackend)
    assert (execution.dtype, execution.kv_dtype) == (torch.bfloat16, torch.bfloat16)
    assert choose_execution("bfloat16", "float16").kv_dtype == torch.float16
    assert describe(execution, [])["gemv"] == "dense bfloat16 torch F.linear"


@pytest.mark.parametrize("has_bf16", [True, False])
def test_bfloat16_on_a_cpu_without_bf16_instructions_is_run_with_a_warning(has_bf16, monkeypatch, caplog):
    """Without avx512_bf16 or AMX, torch emulates bfloat16 (F.linear of 32 rows 5x slower
    than float32 on a Zen 3): the user who asked for it hears so at start-up."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: has_bf16)
    with caplog.at_level("WARNING", logger="sluice.model.execution"):
        execution = choose_execution("bfloat16", "auto")
    assert execution.dtype == torch.bfloat16
    emulated = "this CPU has no bf16 instructions: torch emulates bfloat16"
    assert (emulated in execution.why) == (emulated in caplog.text) == (not has_bf16)


def test_unknown_choices_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        choose_execution("float64")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        choose_execution("auto", "int8")


def test_without_usable_kernels_auto_falls_back_to_torch_ops_and_says_why():
    script = (
        "from sluice.model.execution import choose_execution; e = choose_execution('auto'); "
        "print(e.backend.name, e.why)"
    )
    env = {**os.environ, DISABLE_ENV: "avx512,avx2"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.startswith("torch ") and "C kernels are unavailable" in result.stdout
