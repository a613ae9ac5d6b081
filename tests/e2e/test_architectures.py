"""Architectures beyond the default model's, served for real: tiny random-weight Qwen3
(per-head q/k norm, head_dim * heads != hidden), Phi-3 (fused qkv and gate/up, LongRoPE),
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


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def served(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = build_tiny_model(folder, request.param)
    server = RunningServer("--model-path", str(folder), "--kv-cache-dtype", "float32", "--max-total-tokens", "2000")
    yield server, model
    server.stop()


def test_a_folder_serves_the_greedy_tokens_of_transformers(served):
    server, model = served
    r = generate(server.base_url, input_ids=PROMPT_IDS, sampling_params=greedy(NEW_TOKENS, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(model, PROMPT_IDS, NEW_TOKENS)


def test_a_prompt_many_windows_long_gets_the_tokens_of_transformers(served):
    """150 prompt tokens: Gemma's sliding layers skip whole KV tiles and mask part of one."""
    server, model = served
    if model.config.model_type == "phi3":
        pytest.skip("past 64 positions transformers turns every position to LongRoPE's long factors (layers.py)")
    prompt_ids = [(7 * i) % 4000 + 2 for i in range(150)]
    r = generate(server.base_url, input_ids=prompt_ids, sampling_params=greedy(NEW_TOKENS, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(model, prompt_ids, NEW_TOKENS)


def test_a_folder_answers_chat_completions(served):
    server, _ = served
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
