"""Architectures beyond the default model's, served for real: tiny random-weight Qwen3
(per-head q/k norm, head_dim * heads != hidden) and Phi-3 (fused qkv and gate/up, LongRoPE)
with SmolLM2's tokenizer, through the HTTP server, against transformers on the same weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import RunningServer, generate, greedy

PROMPT_IDS = [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198]
NEW_TOKENS = 12


SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def qwen3_config(vocab_size: int, eos_token_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(**SHAPE, vocab_size=vocab_size, head_dim=32, tie_word_embeddings=True, eos_token_id=eos_token_id)


def phi3_config(vocab_size: int, eos_token_id: int):
    from transformers import Phi3Config

    half = 64 // 4 // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.25 * i for i in range(half)],
        "long_factor": [2.0 + i for i in range(half)],
    }
    return Phi3Config(
        **SHAPE,
        vocab_size=vocab_size,
        original_max_position_embeddings=64,
        rope_parameters=rope,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )


CONFIGS = {"qwen3": qwen3_config, "phi3": phi3_config}


def build_tiny_model(folder: Path, family: str):
    from transformers import AutoModelForCausalLM

    from sluice.model_files import default_model_path
    from sluice.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](len(tokenizer), tokenizer.eos_token_id)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # Random norms too (HF sets them to one), so that a dropped norm shows.
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


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
    with torch.inference_mode():
        expected = model.generate(
            torch.tensor([PROMPT_IDS]),
            attention_mask=torch.ones(1, len(PROMPT_IDS), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )[0, len(PROMPT_IDS) :].tolist()
    assert r.json()["output_ids"] == expected


def test_a_folder_answers_chat_completions(served):
    server, _ = served
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
