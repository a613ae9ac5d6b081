"""A Llama-2-style SentencePiece tokenizer served for real (a tiny random-weight Llama): the
output's text goes on from the prompt's, as SGLang and vLLM decode it, so that the space a
first token spells is kept ("I like" + " cat", where the output decoded alone is "cat"), and
text_offset counts it."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers import RunningServer, generate, greedy
from tests.llama2_tokenizer import llama2_style_tokenizer
from tests.tiny_lms import SHAPE, randomize


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-sentencepiece")
    tokenizer = llama2_style_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, **SHAPE)
    model = LlamaForCausalLM(config).eval()
    randomize(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    server = RunningServer("--model-path", str(folder), "--max-total-tokens", "2000")
    yield server, tokenizer
    server.stop()


def cat_only(tokenizer) -> dict[str, float]:
    """A logit_bias that makes "▁cat" every token of a random-weight model's answer."""
    (cat,) = tokenizer.encode("cat", add_special_tokens=False)
    return {str(cat): 100.0}


def test_native_text_keeps_the_first_tokens_space(served):
    server, tokenizer = served
    (cat,) = tokenizer.encode("cat", add_special_tokens=False)
    r = generate(server.base_url, text="I like", sampling_params=greedy(3, logit_bias={str(cat): 100.0}))
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == [cat] * 3
    assert r.json()["text"] == " cat cat cat"  # decoded alone: "cat cat cat"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_text_and_offsets_go_on_from_the_prompt(served, stream):
    server, tokenizer = served
    body = dict(prompt="I like", max_tokens=3, temperature=0, logit_bias=cat_only(tokenizer), logprobs=0, stream=stream)
    for echo, text, offsets in [(False, " cat cat cat", [0, 4, 8]), (True, "I like cat cat cat", [0, 1, 6, 10, 14])]:
        r = httpx.post(server.base_url + "/v1/completions", json={**body, "echo": echo}, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
            choices = [httpx.Response(200, content=chunk).json()["choices"][0] for chunk in chunks]
            assert "".join(c["text"] for c in choices) == text
            assert [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]] == offsets
        else:
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["logprobs"]["text_offset"]) == (text, offsets)
