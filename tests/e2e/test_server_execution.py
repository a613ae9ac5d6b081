"""The server reports how it runs the model: backend, instruction set, dtypes, kernel paths."""

from __future__ import annotations

import httpx

from sluice.kernels.cpu import reported_flags
from sluice.kernels.loader import kernels_available


def test_server_info_names_the_cpu_features_and_the_kernel_paths(server):
    info = httpx.get(server.base_url + "/get_server_info", timeout=30).json()
    execution = info["execution"]
    assert execution["cpu_flags"] == " ".join(reported_flags())
    if kernels_available():
        # The default never bypasses the kernels: float32 activations, the GGUF's own blocks.
        assert execution["backend"] == "kernels" and execution["activations"] == "float32"
        assert "q4_1" in execution["gemv"] and execution["kv_cache_dtype"] == "float16"
        assert info["dtype"] == "auto" and info["kv_cache_dtype"] == "auto"
    else:
        assert execution["backend"] == "torch"
