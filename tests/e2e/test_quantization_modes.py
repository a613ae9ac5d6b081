"""`--quantization gguf` through the real server: every number of the GGUF kept. The default
model holds Q4_1 and Q8_0 blocks only, which `auto` keeps as they are too, so both modes
must give the same greedy tokens, and a bad mode is refused at start-up. The default model
rewritten with Q5_K, Q5_0 and Q5_1 matrices runs those as q5_k and q5_1 blocks, q/k/v of two
types too."""

from __future__ import annotations

import subprocess
import sys

import gguf
import httpx
import pytest

from sluice.model.gguf_file import read_gguf
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


# The default model with some matrices rewritten as five-bit blocks rounded from the file's
# own weights, as a Q5_K_M file holds them (Q5_0 and Q5_1 where rows are not 256 wide):
# the formats the kernels run them as (before "beside") -> {tensor name's end: GGUF type}.
FIVE_BIT_REWRITES = {
    "q5_k, q5_1": {
        "ffn_down.weight": "Q5_K",  # the only matrices 256 weights wide
        "ffn_gate.weight": "Q5_0",
        "ffn_up.weight": "Q5_0",
        "attn_q.weight": "Q5_1",
        "attn_k.weight": "Q5_1",
        "attn_v.weight": "Q5_1",
    },
    # Gemma 3's Q4_K_M attention: q and k Q5_0 over a Q8_0 v, each part kept in its blocks
    # (stacked in one format, q and k would be rounded to q8_0 and q5_1 not appear).
    "q5_1 beside q8_0": {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0"},
}


@pytest.fixture(scope="module", params=list(FIVE_BIT_REWRITES))
def five_bit_model(request, tmp_path_factory) -> tuple[str, str]:
    """(the kernel format, a copy of the default model with matrices rewritten in it)"""
    source = default_model_path()
    rewrites = FIVE_BIT_REWRITES[request.param]
    replace = {}
    for tensor in read_gguf(source).tensors:
        kind = next((kind for end, kind in rewrites.items() if tensor.name.endswith(end)), None)
        if kind is None:
            continue
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        blocks = (
            quantize_q5_k(weight) if kind == "Q5_K" else gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind])
        )
        replace[tensor.name] = (blocks, kind)
    slug = request.param.replace(", ", "-").replace(" ", "-")
    folder = tmp_path_factory.mktemp(slug)
    return request.param, str(copy_gguf(source, folder / f"smollm2-{slug}.gguf", replace))


def _first_token_candidates(server: RunningServer, question: str) -> list[str]:
    """The five most likely first tokens of the answer, most likely first."""
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 5,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return [entry["token"] for entry in r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]


def test_five_bit_blocks_run_as_themselves_and_answer_as_the_dense_weights(five_bit_model):
    """The kernels multiply the file's Q5_K, Q5_0 and Q5_1 blocks (a wrong fifth bit would
    change every such projection): the answer's likely first tokens are those of the same
    weights made dense. Greedy text may part at a near-tie (int8 activations and each build's
    own summation order: on an AVX2-only CPU the q5_1 copy answers "Two and three ..." where
    the dense weights say "2 + 3 = 5"), so the five most likely first tokens are compared."""
    name, path = five_bit_model
    formats = name.split(" beside ")[0].split(", ")
    candidates = {}
    for mode in ("auto", "none"):
        server = RunningServer("--model-path", path, "--quantization", mode, "--skip-warmup")
        try:
            gemv = httpx.get(server.base_url + "/get_server_info", timeout=30).json()["execution"]["gemv"]
            assert all((format in gemv) == (mode == "auto") for format in formats), gemv
            candidates[mode] = _first_token_candidates(server, "What is 2 + 3?")
        finally:
            server.stop()
    quantized, dense = candidates["auto"], candidates["none"]
    assert quantized[0] in dense[:2] and dense[0] in quantized[:2], candidates
    assert len(set(quantized) & set(dense)) >= 3, candidates
