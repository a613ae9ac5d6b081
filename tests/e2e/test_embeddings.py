"""Embeddings through the real server: OpenAI /v1/embeddings (with the openai client) and
native /encode, against transformers' last hidden states on the same GGUF weights."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.helpers import RunningServer, generate, greedy, internal_states, wait_until_drained, wait_until_running

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Rain falls on the quiet harbour."]


@pytest.fixture(scope="module")
def reference(transformers_default_model):
    """transformers' pooled, normalised final hidden state of a text (last token or mean)."""
    tokenizer, model = transformers_default_model

    def embed(text: str, pooling: str = "last") -> np.ndarray:
        with torch.inference_mode():
            hidden = model(torch.tensor([tokenizer(text).input_ids]), output_hidden_states=True).hidden_states[-1][0]
        pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        return torch.nn.functional.normalize(pooled, dim=0).numpy()

    return embed


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual), np.asarray(expected)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def test_openai_embeddings_match_transformers(base_url, reference):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    response = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS)
    assert [item.index for item in response.data] == [0, 1, 2]
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0
    for text, item in zip(TEXTS, response.data, strict=True):
        assert len(item.embedding) == 576
        assert np.linalg.norm(item.embedding) == pytest.approx(1.0, abs=1e-5)
        # The default server runs the file's Q4_1 blocks with int8 activations, as it does for
        # generation; the float path (--quantization none) is held to 1e-3 below.
        assert relative_error(item.embedding, reference(text)) < 5e-2
        assert float(np.dot(item.embedding, reference(text))) > 0.999


def test_base64_is_the_float32_bytes_of_the_floats(base_url):
    floats = httpx.post(base_url + "/v1/embeddings", json={"input": TEXTS[0]}, timeout=60).json()
    packed = httpx.post(base_url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}, timeout=60)
    decoded = np.frombuffer(base64.b64decode(packed.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, floats["data"][0]["embedding"], atol=1e-4)  # a cached prefix may differ in float16 KV


def test_native_encode_single_batch_and_token_ids(base_url):
    single = httpx.post(base_url + "/encode", json={"text": TEXTS[1]}, timeout=60).json()
    assert set(single) == {"embedding", "meta_info"} and single["meta_info"]["prompt_tokens"] > 0
    batch = httpx.post(base_url + "/encode", json={"text": TEXTS}, timeout=60).json()
    assert [item["index"] for item in batch] == [0, 1, 2]
    assert relative_error(batch[1]["embedding"], single["embedding"]) < 1e-3
    ids = httpx.post(base_url + "/tokenize", json={"prompt": TEXTS[2]}, timeout=60).json()["tokens"]
    by_ids = httpx.post(base_url + "/encode", json={"input_ids": [ids]}, timeout=60).json()
    assert relative_error(by_ids[0]["embedding"], batch[2]["embedding"]) < 1e-3
    wait_until_drained(base_url)


def test_embeddings_share_batches_with_generations(base_url):
    alone = httpx.post(base_url + "/encode", json={"text": "A lighthouse keeper's diary."}, timeout=60).json()
    with ThreadPoolExecutor(2) as pool:
        story = pool.submit(generate, base_url, text="Tell a story.", sampling_params=greedy(48, ignore_eos=True))
        wait_until_running(base_url)
        during = httpx.post(base_url + "/encode", json={"text": "A lighthouse keeper's diary."}, timeout=60).json()
        assert story.result().status_code == 200
    assert relative_error(during["embedding"], alone["embedding"]) < 1e-3
    wait_until_drained(base_url)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ["a", [1, 2]]}, "input"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "priority": -1}, "priority"),
        ({"input": [10**9]}, "input"),
        ({"input": "a", "normalize": False}, "normalize"),
    ],
)
def test_bad_embedding_input_is_refused_naming_the_field(base_url, body, param):
    response = httpx.post(base_url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_bad_encode_input_is_refused_and_leaks_nothing(base_url):
    for body in ({"text": []}, {"text": "a", "input_ids": [1]}, {}, {"input_ids": [1, [2]]}, {"text": ["a", ""]}):
        response = httpx.post(base_url + "/encode", json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
    states = wait_until_drained(base_url)
    assert states["kv_tokens_in_use"] == 0 and internal_states(base_url)["rid_to_state_size"] == 0


def test_the_float_path_matches_transformers_within_1e_3_with_mean_pooling(reference):
    server = RunningServer("--quantization", "none", "--pooling", "mean", "--skip-warmup")
    try:
        response = httpx.post(server.base_url + "/v1/embeddings", json={"input": TEXTS}, timeout=120).json()
        for text, item in zip(TEXTS, response["data"], strict=True):
            assert relative_error(item["embedding"], reference(text, "mean")) < 1e-3
    finally:
        server.stop()
