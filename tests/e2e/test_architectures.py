"""Architectures beyond the default model's, served for real: tiny random-weight Qwen3
(per-head q/k norm, head_dim * heads != hidden, YaRN), Phi-3 (fused qkv and gate/up, LongRoPE),
Gemma 2 (sliding-window layers, soft-capping, sandwich norms, GeGLU) and Gemma 3 (local and
global RoPE, q/k norms) with SmolLM2's tokenizer, through the HTTP server, against
transformers on the same weights."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import RunningServer, generate, greedy
from tests.tiny_lms import CONFIGS, build_tiny_model, hf_greedy

PROMPT_IDS = [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198]
NEW_TOKENS = 12
SWA_CACHE_TOKENS = 20  # Gemma's window layers keep K/V for this many tokens beyond running windows


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def served(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = build_tiny_model(folder, request.param)
    server = RunningServer(
        "--model-path",
        str(folder),
        "--kv-cache-dtype",
        "float32",
        "--max-total-tokens",
        "2000",
        "--swa-cache-tokens",
        str(SWA_CACHE_TOKENS),
    )
    yield server, model
    server.stop()


def test_a_folder_serves_the_greedy_tokens_of_transformers(served):
    server, model = served
    r = generate(server.base_url, input_ids=PROMPT_IDS, sampling_params=greedy(NEW_TOKENS, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(model, PROMPT_IDS, NEW_TOKENS)


def long_prompt_greedy(server: RunningServer, model, prompt_ids: list[int]) -> dict:
    """The server's answer to a greedy request for a prompt past 64 tokens."""
    if model.config.model_type == "phi3":
        pytest.skip("past 64 positions transformers turns every position to LongRoPE's long factors (layers.py)")
    r = generate(server.base_url, input_ids=prompt_ids, sampling_params=greedy(NEW_TOKENS, ignore_eos=True))
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_many_windows_long_gets_the_tokens_of_transformers(served):
    """150 prompt tokens: Gemma's sliding layers skip whole KV tiles and mask part of one."""
    server, model = served
    prompt_ids = [(7 * i) % 4000 + 2 for i in range(150)]
    assert long_prompt_greedy(server, model, prompt_ids)["output_ids"] == hf_greedy(model, prompt_ids, NEW_TOKENS)


def test_a_folder_answers_chat_completions(served):
    server, _ = served
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5


def test_window_layers_keep_only_windows_and_a_continued_prompt_stays_right(served):
    """Gemma's sliding-window layers hold K/V for the windows of running requests and at most
    --swa-cache-tokens more: after a 150-token prompt, 20 tokens' worth at most, while the
    prompt stays cached for the global layers; continuing it gives transformers' tokens."""
    server, model = served
    prompt_ids = [(11 * i) % 4000 + 2 for i in range(150)]
    first = long_prompt_greedy(server, model, prompt_ids)
    (state,) = httpx.get(server.base_url + "/get_server_info", timeout=30).json()["internal_states"]
    windowed = model.config.model_type in ("gemma2", "gemma3_text")
    assert state["kv_tokens_cached"] >= len(prompt_ids)
    if windowed:
        assert 0 < state["kv_window_tokens_held"] <= SWA_CACHE_TOKENS
    else:
        assert state["kv_window_tokens_held"] == 0
    longer = prompt_ids + first["output_ids"] + [(5 * i) % 4000 + 2 for i in range(30)]
    continued = long_prompt_greedy(server, model, longer)
    assert continued["output_ids"] == hf_greedy(model, longer, NEW_TOKENS)
    # The window before the cached sequence's end was kept: it is continued, not recomputed.
    assert continued["meta_info"]["cached_tokens"] >= len(prompt_ids)
