"""The server reports how it runs the model: backend, instruction set, dtypes, kernel paths."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from sluice.config import ServerArgs
from sluice.kernels.cpu import reported_flags
from sluice.kernels.loader import kernels_available, load_kernels
from tests.helpers import RunningServer, generate, greedy, wait_for_states


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


def test_server_info_reports_the_model_name_and_context_length_in_effect(server):
    """Started without --model-path, --served-model-name or --context-length, the server
    reports what it chose, as /get_model_info and /v1/models do, not the empty flags."""
    info = httpx.get(server.base_url + "/get_server_info", timeout=30).json()
    model = httpx.get(server.base_url + "/get_model_info", timeout=30).json()
    [card] = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
    assert info["model_path"] == model["model_path"] and info["model_path"].endswith(".gguf")
    assert info["context_length"] == model["context_len"] > 0
    assert info["served_model_name"] == card["id"]
    # With the default model the execution line names the GGUF's blocks on every build.
    if kernels_available() and "amx" in info["execution"]["kernels_isa"]:
        assert "q4_1" in info["execution"]["gemm"]


def test_bfloat16_runs_torch_ops_and_says_when_the_cpu_emulates_them():
    """--dtype bfloat16 bypasses the kernels by request. On a CPU without bf16 instructions
    torch emulates it, several times slower: the start-up log and /get_server_info say so."""
    import torch

    server = RunningServer("--dtype", "bfloat16", "--max-total-tokens", "2000", "--skip-warmup")
    try:
        execution = httpx.get(server.base_url + "/get_server_info", timeout=30).json()["execution"]
        assert execution["backend"] == "torch" and execution["activations"] == "bfloat16"
        emulated = "this CPU has no bf16 instructions: torch emulates bfloat16"
        has_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        assert (emulated in execution["why"]) == (emulated in server.read_log()) == (not has_bf16)
        r = generate(server.base_url, text="The capital of France is", sampling_params=greedy(4))
        assert r.status_code == 200 and "Paris" in r.json()["text"], r.text
    finally:
        server.stop()


def test_an_fp8_kv_cache_holds_twice_the_tokens_in_the_same_memory_and_answers():
    """--kv-cache-dtype fp8_e5m2: a byte an element, so the same --kv-cache-memory-gb holds twice
    float16's tokens; the server says so and still answers (lossy: not the default's tokens)."""
    fp8 = RunningServer("--kv-cache-dtype", "fp8_e5m2", "--kv-cache-memory-gb", "0.5", "--skip-warmup")
    try:
        info = httpx.get(fp8.base_url + "/get_server_info", timeout=30).json()
        assert info["kv_cache_dtype"] == "fp8_e5m2" and info["execution"]["kv_cache_dtype"] == "fp8_e5m2"
        if kernels_available():
            assert "fp8_e5m2 KV" in info["execution"]["attention"]
            # SmolLM2: K and V of 30 layers x 3 KV heads x 64, a byte each (float16: 23,040 bytes a token).
            loads = httpx.get(fp8.base_url + "/v1/loads", timeout=30).json()["loads"][0]
            assert loads["max_total_num_tokens"] == int(0.5 * 1024**3) // (2 * 30 * 3 * 64)
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}
        r = httpx.post(fp8.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        fp8.stop()


def test_http_processes_run_on_uvloop_and_httptools(server):
    """The processes that answer HTTP run uvicorn on uvloop's event loop and httptools' parser
    (serve_http): their compiled modules are mapped into them, with one HTTP worker and with
    two behind the router alike."""
    main = psutil.Process(server.process.pid)

    def mapped(process: psutil.Process) -> str:
        return " ".join(region.path for region in process.memory_maps())

    maps = [mapped(process) for process in [main, *main.children(recursive=True)]]
    serving = [m for m in maps if "httptools" in m]
    assert len(serving) >= server.tokenizer_worker_num, "no process maps httptools' parser"
    assert all("uvloop" in m for m in serving), "an HTTP process runs without uvloop"


def test_a_prompt_gets_the_same_logprobs_alone_from_the_cache_and_beside_others(server):
    """Every prompt row is multiplied on its own and every token attends at its position (on
    bf16 tiles where the build has them, see the README): the same request gives the same
    tokens and the same logprobs, bit for bit, sent alone, again with its prompt in the radix
    cache, and at once with other prompts that share its prefill steps."""
    execution = httpx.get(server.base_url + "/get_server_info", timeout=30).json()["execution"]
    if kernels_available() and load_kernels().isa == "amx_bf16":
        assert execution["gemm"].startswith("prompt rows: AMX-BF16 tiles")
        assert execution["attention"].endswith("prompt tokens: QK^T and PV on AMX-BF16 tiles")
    words = "the river ran past the old mill where seven children counted boats in the evening light"
    prompt = " ".join([words] * 4)  # ~70 tokens: several prompt tiles

    def answer(text: str) -> tuple[str, list]:
        body = generate(server.base_url, text=text, sampling_params=greedy(12, ignore_eos=True), return_logprob=True)
        body.raise_for_status()
        out = body.json()
        return out["text"], out["meta_info"]["output_token_logprobs"]

    alone = answer(prompt)
    assert answer(prompt) == alone  # its prompt now cached but for the last token
    others = [f"{i} apples and {words} {i}" for i in range(3)]
    with ThreadPoolExecutor(len(others) + 1) as pool:
        futures = [pool.submit(answer, text) for text in [*others, prompt]]
        together = [future.result() for future in futures]
    assert together[-1] == alone


def test_a_busy_core_takes_a_forward_thread_away_and_the_answers_stay_the_same(server):
    """Beside a process that keeps a core busy, the Scheduler runs its forward pass on one
    thread fewer (scheduler/forward_threads.py) and takes the thread back once the core is free
    again. A request gets the same tokens and logprobs, bit for bit, on either count."""
    threads = ServerArgs().threads_per_scheduler()  # what the fixture's server was given
    if threads < 2:
        pytest.skip("one core: the forward pass has no thread to give up")

    def on_threads(count: int, what: str) -> None:
        # Polled at 20 Hz, /get_server_info keeps half a core busy itself: that would count.
        wait_for_states(server.base_url, lambda states: states["forward_threads"] == count, what, poll_s=0.5)

    def answer() -> tuple[str, list]:
        httpx.post(server.base_url + "/flush_cache", timeout=30).raise_for_status()  # compute the prompt again
        text = "Name three rivers of Europe and say which sea each flows into."
        body = generate(server.base_url, text=text, sampling_params=greedy(24, ignore_eos=True), return_logprob=True)
        body.raise_for_status()
        out = body.json()
        return out["text"], out["meta_info"]["output_token_logprobs"]

    on_threads(threads, "every thread in use")
    on_all_threads = answer()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        on_threads(threads - 1, "one thread given up beside a busy loop")
        beside_busy_core = answer()
    finally:
        busy.kill()
        busy.wait()
    on_threads(threads, "the thread taken back once the loop ended")
    assert beside_busy_core == on_all_threads
