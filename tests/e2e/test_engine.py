"""sluice.Engine: the same request path in-process, without HTTP, answering as /generate does."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from sluice import Engine
from sluice.sampling import ClientError
from tests.helpers import greedy


@pytest.fixture(scope="module")
def engine():
    with Engine(max_total_tokens=4000) as e:
        yield e


def test_generate_one_and_many(engine):
    one = engine.generate("The capital of France is", greedy(8))
    assert "Paris" in one["text"]
    assert one["meta_info"]["path"] == "single" and "index" not in one
    many = engine.generate(["The capital of France is", "1, 2, 3,"], greedy(8))
    assert many[0]["text"] == one["text"]
    assert many[1]["meta_info"]["completion_tokens"] == 8


def test_a_list_takes_the_batch_path_in_input_order(engine):
    prompts = ["1, 2, 3,", "a, b, c,", "The capital of France is"]
    params = [greedy(k, ignore_eos=True) for k in (2, 3, 4)]
    results = engine.generate(prompts, params)
    assert [r["index"] for r in results] == [0, 1, 2]
    assert [r["meta_info"]["completion_tokens"] for r in results] == [2, 3, 4]
    assert all(r["meta_info"]["path"] == "batch" for r in results)
    assert [r["text"] for r in results] == [engine.generate(p, q)["text"] for p, q in zip(prompts, params, strict=True)]
    ids = engine.generate([r["output_ids"] for r in results], greedy(1, ignore_eos=True))
    assert [r["index"] for r in ids] == [0, 1, 2] and all(len(r["output_ids"]) == 1 for r in ids)


def test_n_returns_every_sample_with_its_index(engine):
    results = engine.generate(
        "Once upon a time", {"n": 3, "max_new_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    )
    assert [r["index"] for r in results] == [0, 1, 2]
    assert all(r["meta_info"]["path"] == "parallel_sample" and len(r["output_ids"]) == 6 for r in results)
    assert len({r["meta_info"]["id"] for r in results}) == 3
    assert len({r["text"] for r in results}) > 1  # each sample has its own seed
    pairs = engine.generate(["1, 2, 3,", "a, b, c,"], {"n": 2, "max_new_tokens": 3, "temperature": 0})
    assert [r["index"] for r in pairs] == [0, 1, 2, 3]
    assert pairs[0]["text"] == pairs[1]["text"] and pairs[2]["text"] == pairs[3]["text"] != pairs[0]["text"]


def test_a_refused_request_raises_as_generate_answers_400(engine):
    with pytest.raises(ClientError, match="item 1"):
        engine.generate(["fine", "also fine"], [greedy(2), {"temperature": -1}])
    with pytest.raises(ClientError, match="invalid request"):
        engine.generate(5)


def test_logprobs_and_other_fields_as_in_generate(engine):
    out = engine.generate("The capital of France is", greedy(3), return_logprob=True, top_logprobs_num=2, rid="e-1")
    assert out["meta_info"]["id"] == "e-1"
    assert len(out["meta_info"]["output_token_logprobs"]) == 3
    assert all(len(tops) == 2 for tops in out["meta_info"]["output_top_logprobs"])


def test_return_text_in_logprobs_as_in_generate(engine):
    out = engine.generate("The capital of France is", greedy(3), return_logprob=True, return_text_in_logprobs=True)
    assert "".join(text for _, _, text in out["meta_info"]["output_token_logprobs"]) == out["text"]


def test_async_generate(engine):
    out = asyncio.run(engine.async_generate("1, 2, 3,", {"max_new_tokens": 4, "temperature": 0}))
    assert out["text"].strip().startswith("4")


def test_a_script_using_the_engine_ends_cleanly():
    """Leaving `with Engine()` stops the back end and every task on the Engine's loop: the
    interpreter exits by itself, without "Task was destroyed but it is pending"."""
    script = (
        "from sluice.launch import Engine\n"
        "if __name__ == '__main__':\n"
        "    with Engine(skip_warmup=True) as engine:\n"
        "        result = engine.generate('Hi', {'max_new_tokens': 2, 'ignore_eos': True})\n"
        "        print(result['meta_info']['completion_tokens'])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "2"
    assert "Task was destroyed" not in result.stderr and "Traceback" not in result.stderr
