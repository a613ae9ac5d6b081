"""`--quantization gguf` through the real server: every number of the GGUF kept. The default
model holds Q4_1 and Q8_0 blocks only, which `auto` keeps as they are too, so both modes
must give the same greedy tokens, and a bad mode is refused at start-up. The default model
rewritten with Q5_K MLP down projections runs those as q5_k blocks."""

from __future__ import annotations

import subprocess
import sys

import gguf
import httpx
import pytest

from sluice.model_files import default_model_path
from tests.gguf_files import copy_gguf, quantize_q5_k
from tests.helpers import RunningServer, generate, greedy

PROMPT = "Name the capital of France."


def test_gguf_mode_serves_the_tokens_of_the_default_mode(base_url):
    expected = generate(base_url, text=PROMPT, sampling_params=greedy(12, ignore_eos=True))
    assert expected.status_code == 200, expected.text
    server = RunningServer("--quantization", "gguf", "--skip-warmup")
    try:
        r = generate(server.base_url, text=PROMPT, sampling_params=greedy(12, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == expected.json()["output_ids"]
    finally:
        server.stop()


def test_an_unknown_quantization_mode_is_refused_naming_the_choices():
    result = subprocess.run(
        [sys.executable, "-m", "sluice", "serve", "--quantization", "q4_k"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "auto, none, q8_0 or gguf" in result.stderr + result.stdout


@pytest.fixture(scope="module")
def q5_k_model(tmp_path_factory) -> str:
    """SmolLM2 with every ffn_down (the only matrices 256 weights wide) as Q5_K blocks
    rounded from the file's own weights, as a Q5_K_M file would hold them."""
    source = default_model_path()
    replace = {
        tensor.name: (quantize_q5_k(gguf.quants.dequantize(tensor.data, tensor.tensor_type)), "Q5_K")
        for tensor in gguf.GGUFReader(source).tensors
        if tensor.name.endswith("ffn_down.weight")
    }
    return str(copy_gguf(source, tmp_path_factory.mktemp("q5_k") / "smollm2-q5_k.gguf", replace))


def _chat_answer(server: RunningServer, question: str) -> tuple[str, list[int]]:
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0, "logprobs": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], [entry["token"] for entry in choice["logprobs"]["content"]]


def test_q5_k_blocks_run_as_themselves_and_answer_as_the_dense_weights(q5_k_model):
    """The kernels multiply the file's Q5_K blocks (a wrong fifth bit would change every
    down projection): the answer is the one of the same weights made dense."""
    answers = {}
    for mode in ("auto", "none"):
        server = RunningServer("--model-path", q5_k_model, "--quantization", mode, "--skip-warmup")
        try:
            gemv = httpx.get(server.base_url + "/get_server_info", timeout=30).json()["execution"]["gemv"]
            assert ("q5_k" in gemv) == (mode == "auto"), gemv
            answers[mode] = _chat_answer(server, "What is 2 + 3?")
        finally:
            server.stop()
    content, tokens = answers["auto"]
    assert "5" in content
    assert tokens == answers["none"][1]
